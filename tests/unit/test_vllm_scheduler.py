"""kvtier's scheduler half inside vLLM's own asynchronous scheduler.

vLLM's ``AsyncScheduler`` runs as the engine runs it, with kvtier as its
connector (embedded DRAM pool); the test plays the model runner: it
hands back each step's output, sampled tokens and load errors, one step
late, as the engine does under asynchronous scheduling (vLLM's default).
The model is a config.json alone: the scheduler reads no weights.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

B = 16  # tokens a block
BUDGET = 2 * B  # tokens a step: a long prompt's prefill takes several steps


def make_scheduler(tmp_path: Path, blocks: int = 64) -> AsyncScheduler:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 1, "num_hidden_layers": 2, "vocab_size": 1000,
        "max_position_embeddings": 512, "torch_dtype": "float32", "rms_norm_eps": 1e-5}))
    config = VllmConfig(
        model_config=ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=256),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=BUDGET, max_num_seqs=4, max_model_len=256,
                                         enable_chunked_prefill=True, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=B, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvtierConnector", kv_connector_module_path="kvtier.connector", kv_role="kv_both",
            kv_load_failure_policy="recompute", kv_connector_extra_config={"dram_size": "8MB"}),
        device_config=DeviceConfig("cpu"))
    config.cache_config.num_gpu_blocks = blocks
    spec = FullAttentionSpec(block_size=B, num_kv_heads=1, head_size=16, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)])
    init_none_hash(sha256)
    return AsyncScheduler(config, kv, StructuredOutputManager(config), block_size=B)


@pytest.fixture
def scheduler(tmp_path: Path) -> Iterator[AsyncScheduler]:
    s = make_scheduler(tmp_path)
    yield s
    s.shutdown()


def runner_output(step, sampled: dict[str, list[int]], invalid: set[int]) -> ModelRunnerOutput:
    ids = list(step.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[sampled.get(r, []) for r in ids],
                             kv_connector_output=KVConnectorOutput(invalid_block_ids=invalid))


def request(rid: str, prompt: list[int], max_tokens: int = 4) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0), None,
                   block_hasher=get_request_block_hasher(B, sha256))


def in_pool(scheduler: AsyncScheduler, r: Request, blocks: int) -> None:
    """The pool holds ``r``'s first ``blocks`` blocks (saved earlier)."""
    side = scheduler.connector._scheduler
    side.store.prepare_save(side._keys(side._state(r), blocks * B), step=-1)
    side.store.complete_step(-1)


class Engine:
    """The engine's loop, one step behind as under asynchronous scheduling:
    a step's output is handed back after the next step is scheduled. A step
    that reaches a request's prompt end samples a token: 900 + n when the
    step computed on a bad block (the test says which), 100 + n otherwise."""

    def __init__(self, scheduler: AsyncScheduler) -> None:
        self.s, self.in_flight, self.n = scheduler, [], 0

    def schedule(self, bad: set[str] = frozenset()) -> object:  # type: ignore[assignment]
        step = self.s.schedule()
        samples = {r for r in step.num_scheduled_tokens if not self.s.requests[r].is_prefill_chunk}
        self.in_flight.append((step, samples, set(bad)))
        return step

    def output(self, invalid: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        step, samples, bad = self.in_flight.pop(0)
        sampled = {}
        for r in sorted(samples):
            self.n += 1
            sampled[r] = [(900 if r in bad else 100) + self.n]
        self.s.update_from_output(step, runner_output(step, sampled, set(invalid)))

    def run_out(self) -> None:
        for _ in range(60):
            if not self.s.get_num_unfinished_requests() and not self.in_flight:
                return
            if self.s.get_num_unfinished_requests():
                self.schedule()
            self.output()
        raise AssertionError("requests still unfinished after 60 steps")


def finished_clean(r: Request, tokens: int) -> None:
    assert r.is_finished() and len(r.output_token_ids) == tokens, (r.status, list(r.output_token_ids))
    assert all(t < 900 for t in r.output_token_ids), list(r.output_token_ids)  # none sampled on a bad block
    assert r.num_output_placeholders == 0 and r.num_computed_tokens == r.num_tokens - 1


def test_a_token_sampled_on_a_block_that_failed_to_load_never_reaches_the_output(
        scheduler: AsyncScheduler) -> None:
    """Step S loads 8 blocks from the pool for R and computes its next
    chunk; step S+1, planned before S's output, computes R's last chunk
    on them and samples a token. Block 5 fails its check in S. vLLM rolls
    R back to block 5 when S's output arrives; S+1's token, sampled from
    the bad block, must not become R's first output token, though the
    window vLLM checks S+1's report against (R's recompute of one budget,
    less S+1's chunk of one budget) no longer reaches block 5."""
    prompt = list(range(1, 12 * B + 1))  # 12 blocks: 8 from the pool, then two chunks of BUDGET
    r = request("r", prompt)
    in_pool(scheduler, r, 8)
    scheduler.add_request(r)
    engine = Engine(scheduler)
    s0 = engine.schedule(bad={"r"})
    assert s0.num_scheduled_tokens == {"r": BUDGET} and r.num_computed_tokens == 8 * B + BUDGET  # the hit, loaded
    s1 = engine.schedule(bad={"r"})  # planned before S's output: the last chunk, which samples
    assert s1.num_scheduled_tokens == {"r": BUDGET} and r.num_computed_tokens == len(prompt)
    bad = scheduler.kv_cache_manager.get_block_ids("r")[0][5]
    engine.output({bad})
    assert r.num_computed_tokens == 5 * B  # vLLM's rollback to the failed block
    engine.schedule()
    engine.output({bad})  # S+1's output; the worker reports the block again with it
    assert list(r.output_token_ids) == []
    engine.run_out()  # R recomputes from block 5 and samples from its own KV
    finished_clean(r, 4)


def test_a_request_sharing_the_bad_block_through_vllms_prefix_cache_delivers_nothing_sampled_on_it(
        scheduler: AsyncScheduler) -> None:
    """B hits A's loaded blocks in vLLM's own prefix cache in S+1, before
    A's load is known to have failed. On the block's second report vLLM
    moves B back by S+1's chunk only (A recomputes the block in place),
    but B's next step, planned on the token S+1 sampled, is in flight."""
    budget4 = 4 * B
    scheduler.max_num_scheduled_tokens = budget4
    prompt = list(range(1, 8 * B + 9))
    a = request("a", prompt, max_tokens=3)
    in_pool(scheduler, a, 8)
    scheduler.add_request(a)
    engine = Engine(scheduler)
    engine.schedule(bad={"a"})  # S: A loads 8 blocks, computes its tail and samples
    bad = scheduler.kv_cache_manager.get_block_ids("a")[0][5]
    b = request("b", prompt[:8 * B] + [777] * 8, max_tokens=3)
    scheduler.add_request(b)
    engine.schedule(bad={"a", "b"})  # S+1: B hits A's blocks in vLLM's prefix cache
    assert scheduler.kv_cache_manager.get_block_ids("b")[0][5] == bad
    engine.output({bad})
    engine.schedule(bad={"b"})  # S+2: B's decode on S+1's token
    engine.output({bad})
    engine.run_out()
    finished_clean(a, 3)
    finished_clean(b, 3)


def test_a_loader_preempted_while_its_failed_step_runs_delivers_nothing_sampled_on_it(tmp_path: Path) -> None:
    """vLLM checks a failed load's blocks against running requests only: a
    loader preempted (the cache full) while its failing step ran would have
    that step's token delivered as a stale output."""
    s = make_scheduler(tmp_path, blocks=12)
    try:
        engine = Engine(s)
        other = request("o", list(range(500, 529)), max_tokens=40)
        s.add_request(other)
        for _ in range(3):  # the other request decodes
            engine.schedule()
            if len(engine.in_flight) > 1:
                engine.output()
        r = request("r", list(range(1, 8 * B + 9)))
        in_pool(s, r, 8)
        s.add_request(r)
        engine.schedule(bad={"r"})  # S: R loads and samples
        bad = s.kv_cache_manager.get_block_ids("r")[0][5]
        engine.output()
        step = engine.schedule()  # S+1: no room for the other request's next token but R's
        assert "r" in step.preempted_req_ids
        engine.output({bad})  # S's output: the load failed
        assert list(r.output_token_ids) == []
        engine.run_out()
        finished_clean(r, 4)
    finally:
        s.shutdown()


def test_a_request_given_the_bad_block_ahead_of_its_computed_tokens_is_left_alone(tmp_path: Path) -> None:
    """The loader goes away while its failing step runs, and its bad block
    is given to C as a block reserved ahead (a drafter's lookahead), past
    C's computed tokens: vLLM does not move C back, and neither does
    kvtier (C computes that block itself). Marking C's steps as stale
    would lose its token and stop it for good."""
    from vllm.v1.request import RequestStatus

    s = make_scheduler(tmp_path, blocks=11)
    try:
        s.num_lookahead_tokens = B  # what a drafter reserves
        engine = Engine(s)
        r = request("r", list(range(1, 8 * B + 9)))
        in_pool(s, r, 8)
        s.add_request(r)
        engine.schedule(bad={"r"})
        bad = s.kv_cache_manager.get_block_ids("r")[0][7]
        s.finish_requests("r", RequestStatus.FINISHED_ABORTED)  # its client goes away while S runs
        c = request("c", list(range(300, 332)), max_tokens=3)
        s.add_request(c)
        engine.schedule()
        assert bad in s.kv_cache_manager.get_block_ids("c")[0][c.num_computed_tokens // B:]
        engine.output({bad})
        engine.schedule()
        engine.output({bad})
        engine.run_out()
        finished_clean(c, 3)
    finally:
        s.shutdown()
