#!/bin/sh
# kvtier's CUDA copy path checked in one step on a machine with an NVIDIA GPU:
# bit-exact round trips for each paged layout through both copy paths (one DMA
# per block and layer; kernels over the mapped arena), their GB/s against a
# pinned copy_, the tests in tests/cuda (when pytest is there),
# and (with --e2e, when a CUDA build of vLLM is importable) a DRAM hit served by
# vLLM with the device hit's output. Uses the python3 already there (CUDA torch
# 2.11+, numpy, xxhash); installs nothing, needs no network. Arguments go to
# bench/gpu_check.py (--blocks N, --e2e, --shm-dir DIR).
set -eu
here=$(cd "$(dirname "$0")/.." && pwd)
PYTHONPATH="$here/src${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-python3}" "$here/bench/gpu_check.py" "$@"
