import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model_cache_dir() -> Path:
    return Path(os.environ.get("KVTIER_MODEL_CACHE", Path.home() / ".cache" / "kvtier" / "models"))
