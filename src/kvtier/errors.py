"""The one exception family of kvtier.

Expected outcomes (a miss, no room in a tier) are return values, never
exceptions. What is raised here is either a configuration the user must fix
(ConfigError, which names the key and the value) or an I/O or remote failure
that the edge (the connector) turns into "recompute these blocks".
"""

from __future__ import annotations


class KvtierError(Exception):
    """Base of every error kvtier raises on purpose."""


class ConfigError(KvtierError, ValueError):
    """A configuration value is missing, unknown or invalid.

    ``str(err)`` is one line that names the key (with where it came from) and
    the offending value, so it can be shown to an operator as is.
    """

    def __init__(self, key: str, value: object, reason: str, source: str = "") -> None:
        self.key = key
        self.value = value
        self.reason = reason
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(f"kvtier config error: {where}{key} = {value!r}: {reason}")


class TierIOError(KvtierError, OSError):
    """Reading or writing a tier's medium failed; the blocks involved are misses."""


class CorruptBlockError(KvtierError):
    """A block failed its checksum or key check; it is dropped and counted."""


class ClusterError(KvtierError):
    """The cluster tier cannot be reached (its master down, a call failed); its blocks are misses."""
