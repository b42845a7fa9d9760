"""kvtier.hostmem.PageWarmer and the worker that runs it over vLLM's KV
cache in host memory: every page read, nothing changed, the thread stopped
on close.

"Read every page" is observed as the kernel counts it: the first read of a
page of fresh anonymous memory is a minor page fault of the reading thread.
"""

from __future__ import annotations

import ctypes
import mmap
import resource

import numpy as np
import torch

from kvtier.connector.worker import WorkerSide
import pytest

from kvtier.connector import worker as worker_module
from kvtier import hostmem
from kvtier.hostmem import (
    BASE_PAGE,
    WARM_CHUNK_BYTES,
    WARM_INTERVAL_S,
    WARM_MAX_WAIT_S,
    PageWarmer,
    on_virtual_machine,
    warm_interval_s,
    warm_wait_s,
)
from tests.unit.helpers import BLOCK, wait_for


def address(m: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(m))


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def test_a_pass_reads_every_page_and_changes_nothing() -> None:
    # Sizes that end inside a chunk and inside a page.
    fresh = mmap.mmap(-1, WARM_CHUNK_BYTES + 5 * BASE_PAGE)
    data = mmap.mmap(-1, 3 * BASE_PAGE + 100)
    rng = np.random.default_rng(7)
    before = rng.integers(0, 256, len(data), dtype=np.uint8).tobytes()
    data[:] = before
    warmer = PageWarmer([(address(fresh), len(fresh)), (address(data), len(data))], 60.0, keep=(fresh, data))
    try:
        assert warmer.bytes == len(fresh) + len(data)
        f0 = faults()
        warmer.touch()
        assert faults() - f0 >= len(fresh) // BASE_PAGE  # every page of the untouched region read
        assert warmer.passes == 1
        assert data[:] == before and fresh[:] == bytes(len(fresh))
        f1 = faults()
        warmer.touch()  # now resident: no fault (a page or two of the interpreter's own may)
        assert faults() - f1 < len(fresh) // BASE_PAGE // 2
    finally:
        warmer.close()


def test_the_thread_passes_again_until_closed() -> None:
    region = mmap.mmap(-1, 4 * BASE_PAGE)
    warmer = PageWarmer([(address(region), len(region))], 0.01, keep=region).start()
    wait_for(lambda: warmer.passes >= 3, what="three passes")
    warmer.close()
    assert not warmer._thread.is_alive()
    done = warmer.passes
    warmer.touch()  # closed: nothing left to read
    assert warmer.passes == done


def test_the_worker_keeps_a_cpu_kv_cache_warm_each_storage_once() -> None:
    kv = torch.randn(16, 2, BLOCK, 8, dtype=torch.float32)
    before = kv.clone()
    w = WorkerSide(rank=0, num_blocks=16, warm_interval_s=0.01)
    try:
        # Two layers on one storage (KV shared across layers): read once.
        w.register_kv_caches({"l0": kv, "l1": kv.view(16, 2, BLOCK, 8)})
        assert w._warmer is not None and w._warmer.bytes == kv.untyped_storage().nbytes()
        wait_for(lambda: w._warmer.passes >= 2, what="the worker's warmer to pass twice")
        thread = w._warmer._thread
        assert thread.name == "kvtier-warm-0"
    finally:
        w.shutdown()
    assert not thread.is_alive() and w._warmer is None
    assert torch.equal(kv, before)


def test_registering_again_lets_the_first_cache_go() -> None:
    w = WorkerSide(rank=0, num_blocks=16, warm_interval_s=0.01)
    try:
        w.register_kv_caches({"l0": torch.zeros(16, 2, BLOCK, 8, dtype=torch.float32)})
        first = w._warmer
        assert first is not None
        w.register_kv_caches({"l0": torch.zeros(16, 2, BLOCK, 8, dtype=torch.float32)})
        assert not first._thread.is_alive() and w._warmer is not first
    finally:
        w.shutdown()


def test_no_warmer_when_off() -> None:
    w = WorkerSide(rank=0, num_blocks=16, warm_interval_s=0.0)
    w.register_kv_caches({"l0": torch.zeros(16, 2, BLOCK, 8, dtype=torch.float32)})
    assert w._warmer is None
    w.shutdown()


@pytest.mark.parametrize(("interval", "took", "wait"), [
    (1.0, 0.0035, 0.9965),  # a warm pass over 1 GiB: the rest of the second
    (1.0, 0.1, 4.9),  # a pass of 100 ms: 2 % of the time reading
    (1.0, 6.6, WARM_MAX_WAIT_S),  # a cold pass over 10 GiB: not 320 s, or the memory goes cold again
    (30.0, 0.0, 30.0),
])
def test_the_wait_after_a_pass(interval: float, took: float, wait: float) -> None:
    assert warm_wait_s(interval, took) == pytest.approx(wait)


def test_a_warmer_that_cannot_start_leaves_the_worker_working(monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    def refuse(*args: object, **kwargs: object) -> PageWarmer:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(worker_module, "PageWarmer", refuse)
    w = WorkerSide(rank=0, num_blocks=16, warm_interval_s=1.0)
    w.register_kv_caches({"l0": torch.zeros(16, 2, BLOCK, 8, dtype=torch.float32)})
    assert w._warmer is None and w.inert_reason == "" and w.layout is not None
    assert "not kept warm" in caplog.text and "can't start new thread" in caplog.text
    w.shutdown()


CPU = "processor\t: {n}\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu vme de pse tsc msr{extra}\n\n"


@pytest.mark.parametrize(("extra", "vm"), [(" hypervisor lahf_lm", True), (" lahf_lm", False),
                                           (" hypervisorx", False)])
def test_a_virtual_machine_is_told_by_the_cpus_hypervisor_flag(tmp_path, extra: str, vm: bool) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(CPU.format(n=0, extra=extra) + CPU.format(n=1, extra=extra))
    assert on_virtual_machine(str(info)) is vm


def test_without_cpu_flags_it_is_not_taken_for_a_virtual_machine(tmp_path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd\n")  # arm64: no such flag
    assert not on_virtual_machine(str(info))
    assert not on_virtual_machine(str(tmp_path / "missing"))


def test_the_interval_configured_wins_and_unset_means_on_a_vm_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hostmem, "on_virtual_machine", lambda: True)
    assert warm_interval_s(None) == WARM_INTERVAL_S
    assert warm_interval_s(0.0) == 0.0 and warm_interval_s(2.5) == 2.5
    monkeypatch.setattr(hostmem, "on_virtual_machine", lambda: False)
    assert warm_interval_s(None) == 0.0
    assert warm_interval_s(2.5) == 2.5
