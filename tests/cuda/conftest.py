"""Tests that need an NVIDIA GPU and a CUDA build of torch (no vLLM): the
worker's device-copy path with real streams, DMA and kernels over the
mapped arena. ``scripts/gpu_check.sh`` runs them; without a GPU every test
here is skipped (CI has none)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest


@pytest.fixture
def shm_path() -> Iterator[str]:
    path = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp", f"kvtier-cuda-test-{uuid.uuid4().hex}")
    yield path
    for p in (path, path + "-new"):
        if os.path.exists(p):
            os.unlink(p)
