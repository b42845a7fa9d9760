"""kvtier.hostmem: the container's memory limit, read from fake cgroup trees (issue 7, item 13);
pinning; the threshold that makes block copies stream, checked against glibc itself.

Each test writes a mount table, a /proc/self/cgroup and the cgroup files a
kernel would show, under a temporary directory.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from kvtier.hostmem import (GLIBC_TUNABLES, NT_THRESHOLD, NT_TUNABLE, CgroupMemory, cgroup_memory_limit,
                            streaming_copies_line, streaming_copy_env, streaming_threshold, without_streaming)
from kvtier.tools.server import ServerOptions, VllmServer

GiB = 1 << 30


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def v2_tree(tmp_path: Path, leaf: str = "/kubepods/pod1/ctr", mount_root: str = "/") -> tuple[str, str, Path]:
    mount = tmp_path / "cgroup"
    write(tmp_path / "mountinfo",
          "22 1 0:21 / / rw - ext4 /dev/vda1 rw\n"
          f"30 22 0:26 {mount_root} {mount} rw,nosuid - cgroup2 cgroup2 rw\n")
    write(tmp_path / "proc-cgroup", f"0::{leaf}\n")
    return str(tmp_path / "proc-cgroup"), str(tmp_path / "mountinfo"), mount


def test_a_v2_limit_less_the_working_set(tmp_path: Path) -> None:
    proc, mounts, mount = v2_tree(tmp_path)
    leaf = mount / "kubepods/pod1/ctr"
    write(leaf / "memory.max", f"{16 * GiB}\n")
    write(leaf / "memory.current", f"{10 * GiB}\n")
    # 3 GiB of the usage is inactive page cache (the model's files): reclaimable, not counted.
    write(leaf / "memory.stat", f"anon {6 * GiB}\nfile {4 * GiB}\ninactive_file {3 * GiB}\n")
    found = cgroup_memory_limit(proc, mounts)
    assert found == CgroupMemory(str(leaf), 16 * GiB, 7 * GiB)
    assert found.available_bytes == 9 * GiB


def test_the_tightest_ancestor_binds(tmp_path: Path) -> None:
    proc, mounts, mount = v2_tree(tmp_path)
    write(mount / "kubepods/pod1/ctr/memory.max", "max\n")  # the container itself: no limit
    write(mount / "kubepods/pod1/ctr/memory.current", f"{1 * GiB}\n")
    write(mount / "kubepods/pod1/memory.max", f"{4 * GiB}\n")  # the pod: 4 GiB
    write(mount / "kubepods/pod1/memory.current", f"{3 * GiB}\n")
    write(mount / "kubepods/memory.max", f"{64 * GiB}\n")
    write(mount / "kubepods/memory.current", f"{20 * GiB}\n")
    found = cgroup_memory_limit(proc, mounts)
    assert found is not None and found.path == str(mount / "kubepods/pod1")
    assert found.available_bytes == 1 * GiB


def test_no_limit_anywhere_is_none(tmp_path: Path) -> None:
    proc, mounts, mount = v2_tree(tmp_path)
    write(mount / "kubepods/pod1/ctr/memory.max", "max\n")
    assert cgroup_memory_limit(proc, mounts) is None


def test_a_cgroup_namespace_shows_the_container_at_the_mount_root(tmp_path: Path) -> None:
    # With a cgroup namespace /proc/self/cgroup says "0::/" and the mount's root is the container.
    proc, mounts, mount = v2_tree(tmp_path, leaf="/")
    write(mount / "memory.max", f"{8 * GiB}\n")
    write(mount / "memory.current", f"{2 * GiB}\n")
    assert cgroup_memory_limit(proc, mounts) == CgroupMemory(str(mount), 8 * GiB, 2 * GiB)


def test_a_host_path_outside_the_mount_root_falls_back_to_the_mount(tmp_path: Path) -> None:
    proc, mounts, mount = v2_tree(tmp_path, leaf="/docker/abc", mount_root="/docker/abc")
    write(mount / "memory.max", f"{8 * GiB}\n")
    write(mount / "memory.current", f"{1 * GiB}\n")
    assert cgroup_memory_limit(proc, mounts) == CgroupMemory(str(mount), 8 * GiB, 1 * GiB)


def test_a_v1_memory_controller(tmp_path: Path) -> None:
    mount = tmp_path / "memory"
    write(tmp_path / "mountinfo",
          f"35 31 0:32 / {mount} rw,relatime - cgroup cgroup rw,memory\n"
          f"40 31 0:37 / {tmp_path / 'unified'} rw - cgroup2 cgroup2 rw\n")
    write(tmp_path / "proc-cgroup", "4:memory:/process_api/abc\n1:cpu:/\n0::/\n")
    leaf = mount / "process_api/abc"
    write(leaf / "memory.limit_in_bytes", f"{2 * GiB}\n")
    write(leaf / "memory.usage_in_bytes", f"{GiB + GiB // 2}\n")
    write(leaf / "memory.stat", f"cache 100\ntotal_inactive_file {GiB // 2}\n")
    write(mount / "process_api/memory.limit_in_bytes", "9223372036854771712\n")  # v1's "unlimited"
    write(mount / "memory.limit_in_bytes", "9223372036854771712\n")
    found = cgroup_memory_limit(str(tmp_path / "proc-cgroup"), str(tmp_path / "mountinfo"))
    assert found == CgroupMemory(str(leaf), 2 * GiB, 1 * GiB)


def test_no_cgroup_file_system_is_none(tmp_path: Path) -> None:
    write(tmp_path / "mountinfo", "22 1 0:21 / / rw - ext4 /dev/vda1 rw\n")
    write(tmp_path / "proc-cgroup", "0::/\n")
    assert cgroup_memory_limit(str(tmp_path / "proc-cgroup"), str(tmp_path / "mountinfo")) is None
    assert cgroup_memory_limit(str(tmp_path / "missing"), str(tmp_path / "mountinfo")) is None


# --- pinning the arena for device copies ---------------------------------------


class _Driver:
    """Stands in for torch.cuda.cudart() at the driver boundary: answers
    cudaHostRegister with ``code`` and records what was (un)registered."""

    def __init__(self, code: int = 0) -> None:
        self.code = code
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802 - CUDA's name
        self.registered.append((ptr, size, flags))
        return self.code

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.unregistered.append(ptr)
        return 0


def test_pinning_registers_the_region_and_releases_it_once() -> None:
    from kvtier.hostmem import pin_host_memory

    driver = _Driver()
    region, why = pin_host_memory(0x7F0000000000, 1 << 20, cudart=driver)
    assert region is not None and why == ""
    # portable: every context sees it pinned; mapped: kernels may reach it (copy.device_slot_view)
    assert driver.registered == [(0x7F0000000000, 1 << 20, 3)]
    region.release()
    region.release()
    assert driver.unregistered == [0x7F0000000000]


def test_with_the_dma_copies_alone_the_region_is_not_mapped_into_the_device() -> None:
    from kvtier.hostmem import pin_host_memory

    driver = _Driver()
    region, _ = pin_host_memory(0x7F0000000000, 1 << 20, cudart=driver, mapped=False)  # KVTIER_CUDA_COPY=blocks
    assert region is not None and driver.registered == [(0x7F0000000000, 1 << 20, 1)]


def test_a_refused_registration_says_why_and_pins_nothing() -> None:
    from kvtier.hostmem import pin_host_memory

    region, why = pin_host_memory(0x7F0000000000, 1 << 30, cudart=_Driver(code=2))  # cudaErrorMemoryAllocation
    assert region is None
    assert "error 2" in why and "ulimit -l" in why


def test_without_a_cuda_runtime_nothing_is_pinned() -> None:
    # This machine's torch has no CUDA: the worker keeps pageable memory.
    import pytest
    import torch

    from kvtier.hostmem import pin_host_memory

    if torch.cuda.is_available():
        pytest.skip("a CUDA runtime is present")
    region, why = pin_host_memory(0x7F0000000000, 4096)
    assert region is None and why.startswith("no CUDA runtime")


class _PartlyFull(_Driver):
    """Registers ``room`` parts, then answers cudaErrorMemoryAllocation."""

    def __init__(self, room: int) -> None:
        super().__init__()
        self.room = room

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        if len(self.registered) >= self.room:
            return 2
        return super().cudaHostRegister(ptr, size, flags)


def test_a_large_region_is_pinned_in_parts_and_released_part_by_part() -> None:
    """One registration of 512 GiB or more fails whatever the free memory;
    the seeds' node pools reach 1 TB."""
    from kvtier.hostmem import PIN_CHUNK_BYTES, pin_host_memory

    base, size = 0x7F0000000000, 3 * PIN_CHUNK_BYTES + 8192
    driver = _Driver()
    region, why = pin_host_memory(base, size, cudart=driver)
    assert region is not None and why == ""
    assert driver.registered == [(base, PIN_CHUNK_BYTES, 3), (base + PIN_CHUNK_BYTES, PIN_CHUNK_BYTES, 3),
                                 (base + 2 * PIN_CHUNK_BYTES, PIN_CHUNK_BYTES, 3),
                                 (base + 3 * PIN_CHUNK_BYTES, 8192, 3)]
    region.release()
    assert driver.unregistered == [p for p, _, _ in driver.registered]


def test_a_part_refused_unpins_the_others_and_consumes_the_cuda_error(monkeypatch) -> None:
    """The pending error of a failed registration is consumed: left set, the
    next kernel launch of the forward pass raises it and the engine stops."""
    from kvtier import hostmem

    drained = []
    monkeypatch.setattr(hostmem, "drain_cuda_errors", lambda: drained.append(1) or 1)
    driver = _PartlyFull(room=2)
    region, why = hostmem.pin_host_memory(0x7F0000000000, 5 << 20, cudart=driver, chunk_bytes=1 << 20)
    assert region is None and "error 2" in why and "offset 2097152" in why
    assert driver.unregistered == [p for p, _, _ in driver.registered] and len(driver.registered) == 2
    assert drained == [1]


def test_every_mapped_cuda_runtime_is_asked_once(tmp_path) -> None:
    from kvtier.hostmem import drain_cuda_errors

    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f10 r-xp 00000000 fd:00 1 /usr/lib/libcudart.so.12\n"
        "7f10-7f20 r--p 00010000 fd:00 1 /usr/lib/libcudart.so.12\n"
        "7f20-7f30 r-xp 00000000 fd:00 2 /venv/torch/lib/libcudart-9335f6a2.so.12 (deleted)\n"
        "7f30-7f40 r-xp 00000000 fd:00 3 /usr/lib/libc.so.6\n"
        "7f40-7f50 rw-p 00000000 00:00 0\n")
    # Neither library is loaded here: each is tried once (RTLD_NOLOAD) and skipped.
    assert drain_cuda_errors(str(maps)) == 2
    assert drain_cuda_errors(str(tmp_path / "missing")) == 0


def test_no_slot_spans_two_registrations() -> None:
    from kvtier.hostmem import pin_host_memory

    stride = 3 * 4096 + 4096 * 7  # a slot of 40 KiB
    driver = _Driver()
    region, _ = pin_host_memory(0x7F0000000000, 100 * stride, cudart=driver, chunk_bytes=1 << 20, unit=stride)
    assert region is not None
    starts = [p - 0x7F0000000000 for p, _, _ in driver.registered]
    assert all(s % stride == 0 for s in starts) and len(starts) == 4  # 25 slots a part
    assert sum(n for _, n, _ in driver.registered) == 100 * stride


# --- streaming copies (glibc's non-temporal threshold) ----------------------

def test_the_threshold_is_added_beside_the_users_own_tunables() -> None:
    assert streaming_copy_env({}) == {GLIBC_TUNABLES: f"{NT_TUNABLE}=0x8000"}
    assert streaming_copy_env({GLIBC_TUNABLES: "glibc.malloc.arena_max=2"}) == {
        GLIBC_TUNABLES: f"glibc.malloc.arena_max=2:{NT_TUNABLE}=0x8000"}


def test_a_threshold_the_user_set_is_kept_whatever_it_is() -> None:
    for value in ("0x100000000", "0", "junk"):
        assert streaming_copy_env({GLIBC_TUNABLES: f"glibc.malloc.arena_max=2:{NT_TUNABLE}={value}"}) == {}


def test_the_threshold_read_as_glibc_takes_it() -> None:
    assert streaming_threshold({}) is None
    assert streaming_threshold({GLIBC_TUNABLES: f"{NT_TUNABLE}=0x8000"}) == 0x8000
    assert streaming_threshold({GLIBC_TUNABLES: f"a=1:{NT_TUNABLE}=65536:b=2"}) == 65536
    assert streaming_threshold({GLIBC_TUNABLES: f"{NT_TUNABLE}=0x4040"}) is None  # glibc keeps its default
    assert streaming_threshold({GLIBC_TUNABLES: f"{NT_TUNABLE}=0x4041"}) == 0x4041
    assert streaming_threshold({GLIBC_TUNABLES: f"{NT_TUNABLE}=many"}) is None
    assert streaming_threshold({GLIBC_TUNABLES: f"{NT_TUNABLE}=0x8000:{NT_TUNABLE}=0x10000"}) == 0x10000  # last


def test_without_streaming_takes_out_the_threshold_and_keeps_the_rest() -> None:
    env = {"PATH": "/bin", GLIBC_TUNABLES: f"glibc.malloc.arena_max=2:{NT_TUNABLE}=0x8000:glibc.pthread.rseq=0"}
    assert without_streaming(env) == {"PATH": "/bin", GLIBC_TUNABLES: "glibc.malloc.arena_max=2:glibc.pthread.rseq=0"}
    assert GLIBC_TUNABLES in env  # the caller's mapping is left alone
    assert without_streaming({"PATH": "/bin", **streaming_copy_env({})}) == {"PATH": "/bin"}
    assert without_streaming({GLIBC_TUNABLES: f"{NT_TUNABLE}=1:{NT_TUNABLE}=0x8000"}) == {}  # every occurrence
    assert streaming_threshold(without_streaming(streaming_copy_env({GLIBC_TUNABLES: "a=1"}))) is None


def test_the_workers_line_says_whether_its_copies_stream_and_what_to_set() -> None:
    env = streaming_copy_env({})
    assert streaming_copies_line(131072, env) == (True, "copies of 131072 bytes reach glibc's non-temporal "
                                                  f"threshold ({NT_TUNABLE}=0x8000): they stream past the caches")
    streams, line = streaming_copies_line(131072, {})
    assert not streams and f"{GLIBC_TUNABLES}={NT_TUNABLE}=0x8000" in line
    streams, line = streaming_copies_line(20000, env)  # under kvtier's threshold: the line names one that fits
    assert not streams and f"{NT_TUNABLE}={20000:#x}" in line
    streams, line = streaming_copies_line(8192, env)
    assert not streams and "over 0x4040 bytes only" in line


LD_SO = Path("/lib64/ld-linux-x86-64.so.2")


def _glibc_threshold(env: dict[str, str]) -> int:
    out = subprocess.run([str(LD_SO), "--list-tunables"], env=env, capture_output=True, text=True, check=True).stdout
    return int(re.search(rf"^{re.escape(NT_TUNABLE)}: (0x[0-9a-f]+)", out, re.M).group(1), 16)


@pytest.mark.skipif(not LD_SO.exists() or subprocess.run([str(LD_SO), "--list-tunables"],
                                                         capture_output=True).returncode != 0,
                    reason="no x86-64 glibc that lists its tunables (2.33 or later)")
def test_glibc_itself_takes_the_threshold_kvtier_sets_and_agrees_with_the_reading() -> None:
    default = _glibc_threshold({})
    assert _glibc_threshold(streaming_copy_env({})) == NT_THRESHOLD != default
    for value in (0x4040, 0x4041, 0x10000):
        env = {GLIBC_TUNABLES: f"{NT_TUNABLE}={value:#x}"}
        assert _glibc_threshold(env) == (streaming_threshold(env) or default), hex(value)


def test_every_vllm_instance_started_gets_the_threshold_unless_one_is_set(monkeypatch) -> None:
    monkeypatch.delenv(GLIBC_TUNABLES, raising=False)
    opts = ServerOptions(model="m")
    assert streaming_threshold(VllmServer(opts, port=1).environment()) == NT_THRESHOLD
    own = ServerOptions(model="m", env={GLIBC_TUNABLES: f"{NT_TUNABLE}=0x20000"})
    assert VllmServer(own, port=1).environment()[GLIBC_TUNABLES] == f"{NT_TUNABLE}=0x20000"


class _DevicePointers:
    """Stands in for libcuda at the driver boundary: answers
    cuMemHostGetDevicePointer with ``address(host)`` or an error code."""

    def __init__(self, address=lambda p: p, code: int = 0) -> None:  # noqa: ANN001
        self.address, self.code, self.asked = address, code, []

    def cuMemHostGetDevicePointer_v2(self, out, host, flags) -> int:  # noqa: ANN001, N802 - CUDA's name
        self.asked.append(host.value)
        if self.code == 0:
            out.contents.value = self.address(host.value)
        return self.code


def test_a_region_mapped_at_its_host_addresses_is_usable_by_kernels() -> None:
    from kvtier.hostmem import PinnedRegion, mapped_at_host_address

    region = PinnedRegion(_Driver(), 0x7F0000000000, 3 << 20, [0x7F0000000000, 0x7F0000100000, 0x7F0000200000])
    driver = _DevicePointers()
    assert mapped_at_host_address(region, driver) == (True, "")
    assert driver.asked == region.parts  # every registration, not only the first


def test_a_region_mapped_elsewhere_or_not_at_all_keeps_the_dma_copies() -> None:
    from kvtier.hostmem import PinnedRegion, mapped_at_host_address

    region = PinnedRegion(_Driver(), 0x7F0000000000, 2 << 20, [0x7F0000000000, 0x7F0000100000])
    elsewhere = _DevicePointers(lambda p: p if p == 0x7F0000000000 else p + 4096)
    ok, why = mapped_at_host_address(region, elsewhere)
    assert not ok and "0x7f0000101000" in why and "0x7f0000100000" in why
    ok, why = mapped_at_host_address(region, _DevicePointers(code=1))  # CUDA_ERROR_INVALID_VALUE
    assert not ok and "error 1" in why
    ok, why = mapped_at_host_address(region, object())
    assert not ok and "no CUDA driver API" in why
