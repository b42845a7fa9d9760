"""``python -m kvtier.meta``: the node's meta service, the same as ``kvtier meta``.

Reads the files named by ``MMC_META_CONFIG_PATH`` and
``MMC_LOCAL_CONFIG_PATH`` (or ``--meta-config`` / ``--local-config``),
serves the node's pool until SIGINT or SIGTERM, then closes every session
and removes its arena. See kvtier/pool/service.py.
"""

from __future__ import annotations

import sys

from kvtier.pool.main import main

if __name__ == "__main__":
    sys.exit(main())
