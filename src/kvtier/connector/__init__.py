"""vLLM connector. Import path for vLLM: ``kvtier.connector`` (class ``KvtierConnector``).

The class is imported on first use, so that ``kvtier.connector.copy`` and
friends can be imported without loading vLLM.
"""

from typing import Any

__all__ = ["KvtierConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvtierConnector":
        from kvtier.connector.connector import KvtierConnector

        return KvtierConnector
    raise AttributeError(name)
