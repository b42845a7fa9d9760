"""``defer_saves`` inside a real vLLM CPU engine: each step's saves are
copied at the next step's start (vLLM's handle_preemptions), the frees of
finished requests wait for them, and outputs stay identical."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvtier.tools.server import VllmServer
from tests.e2e.conftest import (
    BLOCK,
    assert_loads_succeeded,
    complete,
    complete_batch,
    delta,
    server_options,
    tokens,
)

pytestmark = pytest.mark.e2e

EXT_HITS = "vllm:external_prefix_cache_hits_total"
HOST = 'vllm:prompt_tokens_cached_by_source_total{source="host"}'
DEVICE = 'vllm:prompt_tokens_cached_by_source_total{source="device"}'
FALLBACK = "did not call handle_preemptions"


@pytest.fixture(scope="module")
def deferring(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    log = tmp_path_factory.mktemp("logs") / "vllm-defer.log"
    with VllmServer(server_options(tiny_model, {"dram_size": "256MB", "defer_saves": True}), log_path=log) as srv:
        yield srv


def push_out_of_device_cache(srv: VllmServer, seed: int) -> None:
    for i in range(3):
        complete(srv, tokens(seed + i, 1500), max_tokens=2)


def test_deferred_saves_load_back_and_match_the_device_hit(deferring: VllmServer) -> None:
    a = tokens(1, 24 * BLOCK)
    complete(deferring, a)  # cold: its saves are copied at the start of the steps after
    device_hit = complete(deferring, a)
    push_out_of_device_cache(deferring, seed=100)
    before = deferring.metrics()
    again = complete(deferring, a)
    after = deferring.metrics()
    assert delta(after, before, DEVICE) == 0
    assert delta(after, before, EXT_HITS) == 23 * BLOCK == delta(after, before, HOST)
    assert_loads_succeeded(before, after, 23 * BLOCK)
    assert again["text"] == device_hit["text"]
    log = deferring.log_text()
    assert "a step's saves are copied at the next step's start (defer_saves)" in log
    assert FALLBACK not in log  # vLLM called handle_preemptions before each step: no deferred save dropped


def test_concurrent_requests_with_deferred_saves_give_the_same_outputs(deferring: VllmServer) -> None:
    """Eight concurrent requests over two shared prefixes, 24 tokens each:
    steps save the prefixes' tails and the decoded blocks while other
    requests finish and free theirs. Asked again from DRAM, the same text."""
    prefixes = [tokens(200, 10 * BLOCK), tokens(201, 10 * BLOCK)]
    prompts = [prefixes[i % 2] + tokens(300 + i, 100 + 7 * i) for i in range(8)]
    alone = [complete(deferring, p, max_tokens=24)["text"] for p in prompts]  # one at a time

    def concurrently() -> list[str]:
        push_out_of_device_cache(deferring, seed=500)
        with ThreadPoolExecutor(8) as pool:
            return [r["text"] for r in pool.map(lambda p: complete(deferring, p, max_tokens=24), prompts)]

    before = deferring.metrics()
    first = concurrently()
    second = concurrently()
    after = deferring.metrics()
    assert first == alone and second == alone
    ext = delta(after, before, EXT_HITS)
    assert ext > 0
    assert_loads_succeeded(before, after, ext)
    assert delta(after, before, "kvtier_save_errors_total") == 0
    assert FALLBACK not in deferring.log_text()


def test_requests_preempted_the_step_after_their_saves_keep_what_was_computed(deferring: VllmServer) -> None:
    """Eight cold two-block prompts, asked in one request, decode together
    until they outgrow the device cache (40 blocks: five each). The step
    that fills a block saves it; in the step after, requests need a new
    block, and vLLM preempts others and gives their blocks, the ones just
    saved among them, to the requests that write their next token's KV in
    that step. The deferred saves were copied before: the preempted
    requests resume (loading what they saved) with what each prompt gives
    alone (a miss under another cache salt), and the decoded blocks load
    back from DRAM under the text that follows them.

    Token ids are compared exactly; log-probabilities within 1e-3: decoded
    in a batch of eight, vLLM's matrix products round otherwise than one
    request at a time (a few 1e-6 here). With the deferred copies moved
    after the next step's forward pass, a saved block holds one position
    of another request's KV, and a token id differs."""
    n, decode = 8, 330
    prompts = [tokens(700 + i, 2 * BLOCK) for i in range(n)]
    alone = [complete_batch(deferring, [p], decode, salt="alone") for p in prompts]  # one at a time
    push_out_of_device_cache(deferring, seed=800)
    before = deferring.metrics()
    together = complete_batch(deferring, prompts, decode)
    middle = deferring.metrics()
    assert delta(middle, before, "vllm:num_preemptions_total") > 0
    for (one,), got in zip(alone, together):
        assert got["ids"] == one["ids"]
        assert got["logprobs"] == pytest.approx(one["logprobs"], abs=1e-3)

    # Each prompt with the first 272 tokens it decoded: 400 tokens, six full
    # blocks, four of them decoded (and saved while the requests ran together).
    longer = [p + one["ids"][:272] for p, (one,) in zip(prompts, alone)]
    expected = [complete(deferring, p, max_tokens=8, salt="longer")["text"] for p in longer]
    push_out_of_device_cache(deferring, seed=900)
    start = deferring.metrics()
    again = [complete(deferring, p, max_tokens=8)["text"] for p in longer]
    after = deferring.metrics()
    assert again == expected
    assert delta(after, start, DEVICE) == 0
    ext = delta(after, start, EXT_HITS)
    assert ext == n * 6 * BLOCK
    assert_loads_succeeded(start, after, ext)
    assert delta(after, before, "kvtier_save_errors_total") == 0
    assert FALLBACK not in deferring.log_text()
