"""vLLM connector. Import path for vLLM: ``kvtier.connector`` (class ``KvtierConnector``)."""

from kvtier.connector.connector import KvtierConnector

__all__ = ["KvtierConnector"]
