"""Messages between the scheduler-side and worker-side halves of the connector.

Both travel inside vLLM's own IPC between its processes (vLLM serialises
them); nothing here goes over kvtier's wire.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

if importlib.util.find_spec("vllm") is not None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata
else:  # the worker's copy path without vLLM installed (tests/cuda, bench/gpu_check.py); a vLLM
    # that is installed but lacks these names fails here, as before

    class KVConnectorMetadata:  # type: ignore[no-redef]
        """vLLM's marker base class, where vLLM is not installed."""

    class KVConnectorWorkerMetadata:  # type: ignore[no-redef]
        """vLLM's marker base class, where vLLM is not installed."""


@dataclass
class BlockCopy:
    """One block of this step: vLLM block ``block_id`` <-> pool ``slot`` holding ``key``."""

    block_id: int
    slot: int
    key: bytes


@dataclass
class StepPlan(KVConnectorMetadata):
    """What the workers do in engine step ``step``.

    ``loads`` run before the forward pass (sync loads), ``saves`` after it.
    ``arena`` is the path of the DRAM arena every worker maps. ``delayed``:
    requests that finished while saves of theirs were still being copied
    (device copies only), with the last step that saved for them; vLLM
    frees their blocks once the workers report them in ``get_finished``.
    """

    step: int
    arena: str
    loads: list[BlockCopy] = field(default_factory=list)
    saves: list[BlockCopy] = field(default_factory=list)
    delayed: dict[str, int] = field(default_factory=dict)


@dataclass
class StepReport(KVConnectorWorkerMetadata):
    """What the workers did: per step, how many ranks finished it; failed save slots."""

    done: dict[int, int] = field(default_factory=dict)
    failed_slots: list[int] = field(default_factory=list)
    corrupt_keys: list[bytes] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> StepReport:
        assert isinstance(other, StepReport)
        done = dict(self.done)
        for step, n in other.done.items():
            done[step] = done.get(step, 0) + n
        return StepReport(done, self.failed_slots + other.failed_slots, self.corrupt_keys + other.corrupt_keys)
