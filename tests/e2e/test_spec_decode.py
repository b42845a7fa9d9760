"""kvtier beside speculative decoding (vLLM's n-gram proposer): blocks filled during decode, where draft
tokens are written into the KV cache and some are rejected, are saved only with the KV of the tokens that
were kept, and a later request that loads them answers as it does with nothing cached."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from kvtier.tools.server import VllmServer
from tests.e2e.conftest import BLOCK, assert_loads_succeeded, complete, delta, server_options, tokens

pytestmark = pytest.mark.e2e

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def spec_server(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    log = tmp_path_factory.mktemp("logs") / "vllm-spec.log"
    opts = server_options(tiny_model, {"dram_size": "128MB"}, extra_args=["--speculative-config", json.dumps(SPEC)])
    with VllmServer(opts, log_path=log) as srv:
        yield srv


def generate_ids(srv: VllmServer, prompt: list[int], max_tokens: int) -> list[int]:
    return complete(srv, prompt, max_tokens=max_tokens, ignore_eos=True)["ids"]


def test_blocks_written_during_speculative_decode_load_correctly(spec_server: VllmServer) -> None:
    srv = spec_server
    # A repetitive prompt gives the n-gram proposer something to propose.
    a = (tokens(1, 100) * 10)[:1000]
    before = srv.metrics()
    out = generate_ids(srv, a, 200)  # positions 1000..1199: blocks 15..17 fill up during decode
    after = srv.metrics()
    drafts = delta(after, before, "vllm:spec_decode_num_draft_tokens_total")
    accepted = delta(after, before, "vllm:spec_decode_num_accepted_tokens_total")
    assert drafts > 0, "the n-gram proposer made no draft: speculative decoding was not exercised"
    # Some drafts were rejected: their KV was written and then had to be discarded.
    assert accepted < drafts

    # The next turn: the prompt, the answer, a new question. Its first 18
    # blocks (1,152 tokens) were all saved, three of them during decode.
    follow = a + out[:180] + tokens(2, 200)
    for i in range(3):  # push everything out of the device cache
        complete(srv, tokens(30 + i, 1500), max_tokens=2)
    m0 = srv.metrics()
    hit = complete(srv, follow, max_tokens=16)
    m1 = srv.metrics()
    assert delta(m1, m0, "vllm:external_prefix_cache_hits_total") == 18 * BLOCK
    assert_loads_succeeded(m0, m1, 18 * BLOCK)

    # The same request with nothing cached anywhere computes every token.
    r = httpx.post(srv.url + "/reset_prefix_cache", params={"reset_external": "true"}, timeout=60)
    assert r.status_code == 200, r.text
    m2 = srv.metrics()
    cold = complete(srv, follow, max_tokens=16)
    assert delta(srv.metrics(), m2, "vllm:external_prefix_cache_hits_total") == 0
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert hit["text"] == cold["text"]
