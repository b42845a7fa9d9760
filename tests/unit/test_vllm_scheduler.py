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


@pytest.fixture
def scheduler(tmp_path: Path) -> Iterator[AsyncScheduler]:
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
    config.cache_config.num_gpu_blocks = 64
    spec = FullAttentionSpec(block_size=B, num_kv_heads=1, head_size=16, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)])
    init_none_hash(sha256)
    s = AsyncScheduler(config, kv, StructuredOutputManager(config), block_size=B)
    yield s
    s.shutdown()


def runner_output(step, sampled: dict[str, list[int]], invalid: set[int]) -> ModelRunnerOutput:
    ids = list(step.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[sampled.get(r, []) for r in ids],
                             kv_connector_output=KVConnectorOutput(invalid_block_ids=invalid))


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
    r = Request("r", prompt, SamplingParams(max_tokens=4, temperature=0), None,
                block_hasher=get_request_block_hasher(B, sha256))
    side = scheduler.connector._scheduler
    keys = side._keys(side._state(r), 8 * B)
    side.store.prepare_save(keys, step=-1)
    side.store.complete_step(-1)
    scheduler.add_request(r)

    s0 = scheduler.schedule()
    assert s0.num_scheduled_tokens == {"r": BUDGET} and r.num_computed_tokens == 8 * B + BUDGET  # the hit, loaded
    s1 = scheduler.schedule()  # planned before S's output: the last chunk, which samples
    assert s1.num_scheduled_tokens == {"r": BUDGET} and r.num_computed_tokens == len(prompt)
    bad = scheduler.kv_cache_manager.get_block_ids("r")[0][5]
    scheduler.update_from_output(s0, runner_output(s0, {}, {bad}))
    assert r.num_computed_tokens == 5 * B  # vLLM's rollback to the failed block
    in_flight = [(scheduler.schedule(), False)]  # (step, whether it samples: it reaches the prompt's end)
    # S+1's output, its token sampled on the bad block; the worker reports the block again with it.
    scheduler.update_from_output(s1, runner_output(s1, {"r": [999]}, {bad}))
    assert list(r.output_token_ids) == []

    # The rest runs clean: R recomputes from block 5 and samples from its own KV.
    for n in range(40):
        if r.is_finished():
            break
        step = scheduler.schedule()
        in_flight.append((step, "r" in step.num_scheduled_tokens and r.num_computed_tokens >= len(prompt)))
        step, samples = in_flight.pop(0)
        scheduler.update_from_output(step, runner_output(step, {"r": [100 + n]} if samples else {}, set()))
    assert r.is_finished() and len(r.output_token_ids) == 4 and 999 not in r.output_token_ids
    assert r.num_output_placeholders == 0
