"""Real vLLM CPU servers with a small model built on the spot.

Servers are module-scoped and run one at a time (the machine has 2 cores).
Prompts are token-id lists, so their lengths are exact.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvtier.tools.model import build_model
from kvtier.tools.server import ServerOptions, VllmServer, vllm_shm_files

BLOCK = 64
DEVICE_BLOCKS = 40  # a device cache of 2,560 tokens: too small for the working set
CHUNK = 512  # prefill chunk, shorter than every long prompt here
# Tests that count SSD or cluster hits exactly: vLLM waits for the whole
# promotion to DRAM, not the default 5 s after which the scheduler takes
# the part that has arrived (a loaded machine's first reads can be slower).
PROMOTE_WAIT = {"promote_timeout_s": "60s"}


@pytest.fixture(scope="module", autouse=True)
def no_shared_memory_left_behind() -> Iterator[None]:
    """vLLM's segments in /dev/shm that a module's servers mapped are gone
    once they have stopped or been killed (autouse: set up before the
    module's servers, torn down after them)."""
    seen: set[str] = set()
    stop = VllmServer.stop

    def noting_stop(self: VllmServer) -> None:
        if self.proc is not None:
            seen.update(self.shm_files | vllm_shm_files(self.pids()))
        stop(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(VllmServer, "stop", noting_stop)
        yield
    assert sorted(p for p in seen if os.path.exists(p)) == []


@pytest.fixture(scope="session")
def tiny_model(model_cache_dir: Path) -> str:
    return str(build_model("tiny", cache_dir=model_cache_dir))


def server_options(model: str, kvtier: dict | None, **kw: object) -> ServerOptions:
    # float32: a cold prefill and a cache hit give bit-identical logits, so
    # outputs can be compared across servers (see docs/architecture.md).
    base = dict(model=model, kvtier=kvtier, block_size=BLOCK, num_gpu_blocks=DEVICE_BLOCKS,
                max_num_batched_tokens=CHUNK, dtype="float32", env={"VLLM_LOG_STATS_INTERVAL": "1"})
    base.update(kw)
    return ServerOptions(**base)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def gqa_model(model_cache_dir: Path) -> str:
    return str(build_model("gqa", cache_dir=model_cache_dir))


@pytest.fixture(scope="module")
def kvtier_server(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    log = tmp_path_factory.mktemp("logs") / "vllm-kvtier.log"
    with VllmServer(server_options(tiny_model, {"dram_size": "256MB"}), log_path=log) as srv:
        yield srv


@pytest.fixture(scope="module")
def plain_server(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    log = tmp_path_factory.mktemp("logs") / "vllm-plain.log"
    with VllmServer(server_options(tiny_model, None), log_path=log) as srv:
        yield srv


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(16, 900) for _ in range(n)]


def complete(srv: VllmServer, prompt: list[int], max_tokens: int = 12, salt: str | None = None,
             ignore_eos: bool = False) -> dict:
    """Greedy completion of ``prompt``; ``salt``: vLLM's cache salt, under
    which the prompt's blocks are keyed apart (a miss in both caches);
    ``ignore_eos``: decode all ``max_tokens``. The answer's text, its
    token ids (``ids``) and vLLM's usage figures."""
    body = {"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": ignore_eos, "return_token_ids": True}
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    answer = r.json()
    choice = answer["choices"][0]
    return {"text": choice["text"], "ids": choice["token_ids"], "usage": answer["usage"]}


def complete_batch(srv: VllmServer, prompts: list[list[int]], max_tokens: int, salt: str | None = None
                   ) -> list[dict]:
    """Greedy completions of ``prompts`` asked in one request, so that vLLM
    has them all from its first step on, each decoding all ``max_tokens``
    (``salt`` as for :func:`complete`): each answer's token ids (``ids``)
    and their log-probabilities (``logprobs``)."""
    body = {"model": "model", "prompt": prompts, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, "logprobs": 1}
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert len(choices) == len(prompts)
    return [{"ids": c["token_ids"], "logprobs": c["logprobs"]["token_logprobs"]} for c in choices]


def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def wait_for_log(srv: VllmServer, pattern: str, timeout_s: float = 15.0) -> list[str]:
    """Lines of the server's log matching ``pattern`` (regex), waiting for at least one."""
    import re

    deadline = time.monotonic() + timeout_s
    while True:
        found = [line for line in srv.log_text().splitlines() if re.search(pattern, line)]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def assert_loads_succeeded(before: dict[str, float], after: dict[str, float], hit_tokens: float,
                           ranks: int = 1) -> None:
    """The external hits between ``before`` and ``after`` were loaded, not recomputed.

    vLLM counts an external hit when it schedules the load, before the load
    runs, and a float32 recompute gives the same text: hit counters and text
    alone pass when every load fails. Loads that succeeded show as blocks
    loaded (each rank counts its share of every block) and no load error.

    A request that vLLM preempts and schedules again loads its prefix again,
    but vLLM counts the hits of a preempted request apart, in figures it does
    not export: with preemptions in the window, kvtier loads more blocks than
    the hit counter shows, never fewer.
    """
    assert delta(after, before, "kvtier_load_errors_total") == 0
    loaded = delta(after, before, "kvtier_blocks_loaded_total")
    if delta(after, before, "vllm:num_preemptions_total") == 0:
        assert loaded == hit_tokens // BLOCK * ranks
    else:
        assert loaded >= hit_tokens // BLOCK * ranks
    assert delta(after, before, "kvtier_corrupt_blocks_total") == 0


def hit_after_eviction(srv: VllmServer, prompt: list[int], filler_seed: int
                       ) -> tuple[dict, dict, dict[str, float], dict[str, float]]:
    """Ask ``prompt`` cold and again (a device hit), push it out of the device
    cache with three 1,500-token fillers, ask it once more.

    Returns the device hit, the last answer, and /metrics before and after
    the last request.
    """
    complete(srv, prompt)
    device_hit = complete(srv, prompt)
    for i in range(3):
        complete(srv, tokens(filler_seed + i, 1500), max_tokens=2)
    before = srv.metrics()
    again = complete(srv, prompt)
    after = srv.metrics()
    return device_hit, again, before, after


RECONNECTED = "kvtier: reconnected to the meta service"


def reconnects(srv: VllmServer) -> int:
    return srv.log_text().count(RECONNECTED)


def wait_reconnected(srv: VllmServer, seen: int, timeout_s: float = 60) -> None:
    """Until ``srv``'s scheduler has its new session in use: the service
    lists a client at its hello, before the client has read the answer, and
    a request scheduled in between would miss."""
    deadline = time.monotonic() + timeout_s
    while reconnects(srv) <= seen:
        if time.monotonic() > deadline:
            raise AssertionError(f"{srv.url} did not reconnect to the meta service")
        time.sleep(0.05)
