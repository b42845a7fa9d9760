"""The randomized correctness run, small enough for CI (tests/stress/correctness.py runs the full one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.stress.correctness import StressOptions, run, verdict

pytestmark = pytest.mark.e2e


def test_200_random_requests_with_faults_match_vllm_alone(tiny_model: str, tmp_path: Path) -> None:
    # The noise pass (vLLM alone against itself) is left to the full run,
    # whose last result docs/reliability.md records: 0 of 1,000.
    summary = run(StressOptions(requests=200, concurrency=8, seed=1, workdir=str(tmp_path),
                                model=tiny_model, noise_pass=False))
    print(json.dumps(summary, indent=2))
    assert verdict(summary) == []
    assert summary["divergent (kvtier vs vLLM alone)"] == 0
    assert summary["recovered_line"]
