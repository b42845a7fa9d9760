"""Host memory facts the DRAM tier depends on: free memory, the container's
memory limit, hugetlbfs mounts, free huge pages; pinning host memory for
device copies; keeping host memory warm for the copies into it; and
glibc's setting that makes host copies stream past the caches.

Facts are read from /proc and /sys at start-up (configuration checks,
arena creation). :func:`pin_host_memory` runs in a worker process whose KV
lives on a CUDA device, once per arena it maps; :class:`PageWarmer` on a
thread of its own, in a worker process whose KV lives in host memory and
in the process that owns the arena.
Nothing here is on a serving path.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

BASE_PAGE = 4096


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (the kernel's estimate), in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable missing from /proc/meminfo")


def filesystem_type(path: str, mountinfo: str = "/proc/self/mountinfo") -> str:
    """Type of the file system ``path`` lives on ("tmpfs", "hugetlbfs", ...), or "" if unknown."""
    target = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open(mountinfo) as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields = left.split()
                if len(fields) < 5 or not right:
                    continue
                point = fields[4].replace("\\040", " ")
                inside = target == point or target.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, right.split()[0]
    except OSError:
        return ""
    return kind


def hugetlbfs_page_size(directory: str) -> int | None:
    """The huge page size of a hugetlbfs mount holding ``directory``; None
    for any other file system (a large block size alone proves nothing:
    tmpfs reports 64 KiB on hosts with 64 KiB base pages)."""
    if filesystem_type(directory) != "hugetlbfs":
        return None
    return os.statvfs(directory).f_bsize


def free_huge_pages(page_bytes: int) -> int:
    """Huge pages of ``page_bytes`` that a new mapping can take: free, less
    those reserved by mappings made but not yet touched."""
    base = f"/sys/kernel/mm/hugepages/hugepages-{page_bytes // 1024}kB"
    try:
        with open(f"{base}/free_hugepages") as f:
            free = int(f.read())
        with open(f"{base}/resv_hugepages") as f:
            reserved = int(f.read())
    except OSError:
        return 0
    return max(0, free - reserved)


# cgroup v1 reports "no limit" as the largest page-aligned signed 64-bit value.
_V1_UNLIMITED = 1 << 62


@dataclass(frozen=True)
class CgroupMemory:
    """The memory limit that binds this process, and what is used under it.

    ``used_bytes`` is the working set (usage less inactive file pages), as
    the kubelet counts it: page cache of the model's files is reclaimed
    before the OOM killer runs, so counting it would refuse a size that fits.
    """

    path: str  # the cgroup directory whose limit binds
    limit_bytes: int
    used_bytes: int

    @property
    def available_bytes(self) -> int:
        return max(0, self.limit_bytes - self.used_bytes)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (v2: no limit) -> None


def _stat_value(path: str, name: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == name:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_mounts(mountinfo: str) -> tuple[tuple[str, str] | None, tuple[str, str] | None]:
    """((root, mount point) of cgroup v2, (root, mount point) of the v1 memory controller)."""
    v2 = v1 = None
    try:
        with open(mountinfo) as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, kind = left.split(), right.split()
                if len(fields) < 5 or len(kind) < 3:
                    continue
                root, point = fields[3], fields[4].replace("\\040", " ")
                if kind[0] == "cgroup2" and v2 is None:
                    v2 = (root, point)
                elif kind[0] == "cgroup" and "memory" in kind[2].split(",") and v1 is None:
                    v1 = (root, point)
    except OSError:
        pass
    return v2, v1


def _cgroup_dir(mount: tuple[str, str], path: str) -> str:
    """The directory of cgroup ``path`` under a mount whose root is ``mount[0]``.

    Inside a container the mount's root is usually the container's own
    cgroup (or the path is "/" with a cgroup namespace); a path outside the
    mount's root falls back to the mount point.
    """
    root, point = mount
    rel = os.path.relpath(path, root) if path.startswith(root) else "."
    return os.path.normpath(os.path.join(point, rel)) if not rel.startswith("..") else point


def cgroup_memory_limit(proc_cgroup: str = "/proc/self/cgroup",
                        mountinfo: str = "/proc/self/mountinfo") -> CgroupMemory | None:
    """The tightest memory limit on this process's cgroup and its ancestors
    (cgroup v2 ``memory.max``, or v1 ``memory.limit_in_bytes``), or None
    when there is none (or no cgroup file system is visible).

    A DRAM arena on tmpfs is charged to the cgroup of the process that
    allocates it, so a container's limit caps it however much the host has.
    """
    v2_mount, v1_mount = _cgroup_mounts(mountinfo)
    v2_path = v1_path = None
    try:
        with open(proc_cgroup) as f:
            for line in f:
                parts = line.rstrip("\n").split(":", 2)
                if len(parts) != 3:
                    continue
                if parts[0] == "0" and parts[1] == "":
                    v2_path = parts[2]
                elif "memory" in parts[1].split(","):
                    v1_path = parts[2]
    except OSError:
        return None
    if v1_mount is not None and v1_path is not None:
        start, top = _cgroup_dir(v1_mount, v1_path), v1_mount[1]
        files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    elif v2_mount is not None and v2_path is not None:
        start, top = _cgroup_dir(v2_mount, v2_path), v2_mount[1]
        files = ("memory.max", "memory.current", "inactive_file")
    else:
        return None
    best: CgroupMemory | None = None
    here = start
    while True:
        limit = _read_int(os.path.join(here, files[0]))
        if limit is not None and limit < _V1_UNLIMITED:
            usage = _read_int(os.path.join(here, files[1])) or 0
            inactive = _stat_value(os.path.join(here, "memory.stat"), files[2])
            found = CgroupMemory(here, limit, max(0, usage - inactive))
            if best is None or found.available_bytes < best.available_bytes:
                best = found
        if os.path.normpath(here) == os.path.normpath(top) or here in ("/", ""):
            break
        here = os.path.dirname(here)
    return best


# --- page-locked (pinned) host memory for device copies ------------------------

_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process
_HOST_REGISTER_MAPPED = 2  # cudaHostRegisterMapped: in the device's address space (kernels reach it)
# One registration of 512 GiB or more fails whatever the free memory (seen
# on H200 nodes); the seeds' pools reach 1 TB (128 GB x 8 devices). Regions
# are registered in parts of at most this size (whole pages; a block copy
# never needs to span two registrations to be asynchronous).
PIN_CHUNK_BYTES = 64 << 30


class PinnedRegion:
    """Host memory registered as page-locked with the CUDA driver, in parts.

    Made by :func:`pin_host_memory` in a worker process, for the DRAM arena
    that device copies read and write: DMA from pinned memory runs
    asynchronously on a stream; from pageable memory the driver stages it
    through a bounce buffer and the copy blocks the caller. ``release``
    unregisters it; it must run before the memory is unmapped. Not
    thread-safe: one worker thread owns it.
    """

    def __init__(self, cudart, ptr: int, size_bytes: int, parts: list[int] | None = None) -> None:
        self._cudart = cudart
        self.ptr = ptr
        self.size_bytes = size_bytes
        self.parts = parts if parts is not None else [ptr]  # the address of each registration

    def release(self) -> None:
        cudart, self._cudart = self._cudart, None
        if cudart is None:
            return
        failed = False
        for part in self.parts:
            code = cudart.cudaHostUnregister(part)
            failed = failed or int(getattr(code, "value", code) or 0) != 0
        if failed:
            drain_cuda_errors()


def drain_cuda_errors(maps_path: str = "/proc/self/maps") -> int:
    """Consume the error a failed CUDA runtime call left pending on this
    thread, in every CUDA runtime library mapped into the process; returns
    how many libraries were asked.

    A failed ``cudaHostRegister`` (torch's binding returns its code and
    leaves the error set) would otherwise be raised by the next checked
    CUDA call on vLLM's thread, a kernel launch of the forward pass, as a
    misleading "CUDA error: out of memory", and the engine would stop.
    torch's binding has no ``cudaGetLastError``, so each mapped libcudart
    (a wheel may bundle its own, ``libcudart-<hash>.so.12``, beside the
    system's) is asked through ctypes; opening one already mapped returns
    that instance.
    """
    import ctypes

    paths: list[str] = []
    try:
        with open(maps_path) as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) < 6:
                    continue
                path = fields[5].strip().removesuffix(" (deleted)")
                if "libcudart" in os.path.basename(path) and path not in paths:
                    paths.append(path)
    except OSError:
        return 0
    for path in paths:
        try:
            ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0) | os.RTLD_LAZY).cudaGetLastError()
        except (OSError, AttributeError):
            continue
    return len(paths)


def pin_host_memory(ptr: int, size_bytes: int, cudart=None, chunk_bytes: int = PIN_CHUNK_BYTES,
                    unit: int = 4096, mapped: bool = True) -> tuple[PinnedRegion | None, str]:
    """Register ``size_bytes`` at ``ptr`` as page-locked memory, in parts of
    at most ``chunk_bytes`` that are whole multiples of ``unit`` (the arena's
    slot stride: no slot, so no block copy, spans two registrations, which
    could make that copy synchronous): (region, "") or (None, why).

    ``cudart`` is torch's CUDA runtime binding (``torch.cuda.cudart()``),
    given by tests that stand in for the driver. ``mapped``: also map it
    into the devices' address space (copy.device_slot_view's kernels read
    and write it there). Registration fails on a
    low ``ulimit -l`` or a container's locked-memory limit, or without a
    CUDA runtime; the parts registered are then unregistered, the pending
    CUDA error is consumed (:func:`drain_cuda_errors`), and the caller
    copies through pageable memory (correct, slower, and copies block the
    caller) and logs the reason once.
    """
    if cudart is None:
        try:
            import torch

            cudart = torch.cuda.cudart()
        except Exception as err:  # noqa: BLE001 - no CUDA runtime: nothing to pin for
            return None, f"no CUDA runtime ({err})"
    unit = max(4096, unit)
    chunk = max(unit, chunk_bytes // unit * unit)
    flags = _HOST_REGISTER_PORTABLE | (_HOST_REGISTER_MAPPED if mapped else 0)
    parts: list[int] = []
    why = ""
    for start in range(0, size_bytes, chunk):
        n = min(chunk, size_bytes - start)
        try:
            code = cudart.cudaHostRegister(ptr + start, n, flags)
        except Exception as err:  # noqa: BLE001 - a binding that raises instead of returning a code
            why = f"cudaHostRegister raised {err}"
            break
        code = int(getattr(code, "value", code))
        if code != 0:
            why = (f"cudaHostRegister of {n} bytes at offset {start} of {size_bytes} returned error {code} "
                   f"(locked-memory limit: ulimit -l {_memlock_limit()})")
            break
        parts.append(ptr + start)
    if why:
        drain_cuda_errors()
        if parts:
            PinnedRegion(cudart, ptr, size_bytes, parts).release()
        return None, why
    return PinnedRegion(cudart, ptr, size_bytes, parts), ""


def mapped_at_host_address(region: PinnedRegion, driver=None) -> tuple[bool, str]:
    """Whether every part of ``region`` is mapped into the current CUDA
    context's address space at its own host address (unified addressing,
    and a device that can use host pointers for registered memory, as on
    x86-64 Linux): then kernels may read and write the region through a
    device tensor over the same addresses (copy.device_slot_view). (ok, why
    not). ``driver``: libcuda's binding, given by tests; asked on the
    thread that registered the region (its context is current there)."""
    try:
        if driver is None:
            driver = ctypes.CDLL("libcuda.so.1")
        get = driver.cuMemHostGetDevicePointer_v2
    except (OSError, AttributeError) as err:
        return False, f"no CUDA driver API ({err})"
    for part in region.parts:
        dptr = ctypes.c_uint64(0)
        code = int(get(ctypes.pointer(dptr), ctypes.c_void_p(part), ctypes.c_uint(0)))
        if code != 0:
            return False, f"cuMemHostGetDevicePointer returned error {code}"
        if dptr.value != part:
            return False, f"mapped at device address {dptr.value:#x}, not at its host address {part:#x}"
    return True, ""


def _memlock_limit() -> str:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft // 1024} KiB"


# Streaming copies. glibc's memmove writes copies of at least
# glibc.cpu.x86_non_temporal_threshold bytes with non-temporal stores, which
# skip reading the destination's cache lines first and leave the caches to
# other work; below it, ``rep movsb`` or vector loops through the caches. The
# default threshold is worked out from the cache sizes (99 MiB on the test
# machine): every copy of a block's layer (tens to hundreds of KiB)
# goes through the caches, though neither side is read again soon (a save's
# slot is read by a later load, maybe on another instance; a load's blocks
# are read once by the next forward pass). Lowered to 32 KiB, an 8k-token
# load outside vLLM took 9.9-11.4 ms instead of 14.5-15.0 and a pool hit's
# TTFT 1.04-1.13x a device hit instead of 1.14-1.30x (docs/benchmarks.md).
# glibc 2.36-2.38 on AMD CPUs keeps ``rep movsb`` for copies under the L2
# size whatever the threshold; the docs say so.
# It is a setting of the whole process, read once when it starts: kvtier
# sets it for the vLLM instances it starts (tools/server.py, kvtier serve),
# and a worker says at start whether its copies get it.
GLIBC_TUNABLES = "GLIBC_TUNABLES"
NT_TUNABLE = "glibc.cpu.x86_non_temporal_threshold"
NT_THRESHOLD = 0x8000  # bytes: copies of 32 KiB and more stream
NT_MIN_EXCLUSIVE = 0x4040  # glibc 2.36 keeps its default for a value at or below this


def _tunables(value: str) -> list[tuple[str, str]]:
    """``name=value`` pairs of a GLIBC_TUNABLES string (colon-separated)."""
    return [tuple(item.split("=", 1)) for item in value.split(":") if "=" in item]  # type: ignore[misc]


def streaming_copy_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to add to ``environ`` for a process whose block copies
    should stream (:data:`NT_THRESHOLD`): GLIBC_TUNABLES with the threshold
    appended to the tunables already there; nothing when ``environ``
    already sets the threshold (the user's value is kept, whatever it is)."""
    current = environ.get(GLIBC_TUNABLES, "")
    if any(name == NT_TUNABLE for name, _ in _tunables(current)):
        return {}
    item = f"{NT_TUNABLE}={NT_THRESHOLD:#x}"
    return {GLIBC_TUNABLES: f"{current}:{item}" if current else item}


def without_streaming(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with the non-temporal threshold taken out of
    GLIBC_TUNABLES (the variable gone when nothing else is left in it):
    the environment of a process whose copies are glibc's default. Items
    without ``=``, which glibc ignores, are dropped too."""
    env = dict(environ)
    rest = [f"{name}={value}" for name, value in _tunables(env.pop(GLIBC_TUNABLES, "")) if name != NT_TUNABLE]
    if rest:
        env[GLIBC_TUNABLES] = ":".join(rest)
    return env


def streaming_threshold(environ: Mapping[str, str] | None = None) -> int | None:
    """The non-temporal threshold glibc took from ``environ`` (this
    process's by default) at start, or None where it keeps its default: the
    tunable absent, not a number, or at or below glibc's minimum."""
    environ = os.environ if environ is None else environ
    for name, value in reversed(_tunables(environ.get(GLIBC_TUNABLES, ""))):
        if name == NT_TUNABLE:
            try:
                n = int(value, 0)
            except ValueError:
                return None
            return n if n > NT_MIN_EXCLUSIVE else None
    return None


def streaming_copies_line(copy_bytes: int, environ: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """Whether copies of ``copy_bytes`` (a block's layer) reach glibc's
    non-temporal threshold in this process, and a line that says so, or
    says what to set for it."""
    threshold = streaming_threshold(environ)
    if threshold is not None and copy_bytes >= threshold:
        return True, (f"copies of {copy_bytes} bytes reach glibc's non-temporal threshold "
                      f"({NT_TUNABLE}={threshold:#x}): they stream past the caches")
    if copy_bytes <= NT_MIN_EXCLUSIVE:
        return False, (f"copies of {copy_bytes} bytes go through the caches (glibc streams copies over "
                       f"{NT_MIN_EXCLUSIVE:#x} bytes only)")
    value = min(NT_THRESHOLD, copy_bytes)
    return False, (f"copies of {copy_bytes} bytes go through the caches; loads and saves are faster with "
                   f"{GLIBC_TUNABLES}={NT_TUNABLE}={value:#x} in vLLM's environment (docs/configuration.md)")


WARM_INTERVAL_S = 5.0  # the warmers' interval on a virtual machine when not configured


def on_virtual_machine(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether the CPU says it runs under a hypervisor (the ``hypervisor``
    flag x86 CPUs show a guest). Only a VM's host takes back memory left
    alone; on bare metal a warmer would cost CPU for nothing. False when
    it cannot tell (another architecture, no /proc)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return "hypervisor" in line.split(":", 1)[-1].split()
    except OSError:
        pass
    return False


def warm_interval_s(configured: float | None) -> float:
    """The warmers' interval: ``configured``, or when None
    :data:`WARM_INTERVAL_S` on a virtual machine and 0 (off) elsewhere."""
    if configured is not None:
        return configured
    return WARM_INTERVAL_S if on_virtual_machine() else 0.0


WARM_CHUNK_BYTES = 16 << 20  # touched per call (4,096 pages, ~60 us warm): the thread yields between calls
WARM_DUTY = 0.02  # most of its time the warmer spends reading: big regions get longer intervals
WARM_MAX_WAIT_S = 20.0  # longest wait after a pass, however long it took (a cold pass takes ~100x a warm one)


def warm_wait_s(interval_s: float, took_s: float) -> float:
    """How long the warmer waits after a pass that took ``took_s``: the rest
    of ``interval_s``, or longer so that it reads at most ``WARM_DUTY`` of
    the time, but never over ``WARM_MAX_WAIT_S``."""
    return max(interval_s - took_s, min(took_s * (1 / WARM_DUTY - 1), WARM_MAX_WAIT_S))


class PageWarmer:
    """Reads one byte of every 4 KiB page of some host memory regions every
    ``interval_s`` seconds, on a daemon thread.

    Why: a virtual machine's host may take back guest memory that stays
    untouched (swapped or compressed on the host, or tracked as idle), and
    the guest pays when it touches such a page again. Measured on a 2-core
    microVM: writing into memory left alone for 160 s ran at 1.5-1.9 GB/s
    (2.2-2.8 us a page), into memory read a byte a page every 5 s at
    12-14 GB/s. A load writes a block into vLLM's KV cache at blocks vLLM
    has not used the longest (its free list is least recently used first),
    so on such a host each load met cold pages. A pass reads 1 GiB in about
    3.5 ms once the pages are warm; the first pass over cold memory pays
    what the loads would have paid, off their path. Reading never changes
    the memory, so it may run beside the engine's writes. The thread reads
    at most ``WARM_DUTY`` of the time: a pass that takes longer than that
    share of ``interval_s`` (over ~28 GiB warm and idle at 5 s) waits longer after
    it, up to ``WARM_MAX_WAIT_S`` (a pass over cold memory is slow, and a
    wait in proportion would let the memory go cold again).

    ``keep`` holds the objects that own the regions (the KV tensors): the
    regions stay mapped while the warmer may read them. ``passes`` counts
    the passes done.
    """

    def __init__(self, regions: Sequence[tuple[int, int]], interval_s: float, keep: object = None,
                 name: str = "kvtier-warm") -> None:
        self.interval_s = interval_s
        self._keep = keep
        self._views = [np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(ptr)) for ptr, n in regions if n > 0]
        self.bytes = sum(v.size for v in self._views)
        self.passes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def touch(self) -> None:
        """One pass: a byte of every page, ``WARM_CHUNK_BYTES`` a call
        (numpy lets go of the interpreter lock inside each); nothing once closed."""
        if self._stop.is_set():
            return
        for view in self._views:
            for off in range(0, view.size, WARM_CHUNK_BYTES):
                if self._stop.is_set():
                    return
                np.bitwise_or.reduce(view[off : off + WARM_CHUNK_BYTES : BASE_PAGE])
        self.passes += 1

    def start(self) -> PageWarmer:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                self.touch()
            except Exception:  # noqa: BLE001 - warming is an optimisation; never take the worker down
                log.exception("kvtier: keeping host memory warm failed; stopped")
                return
            self._stop.wait(warm_wait_s(self.interval_s, time.monotonic() - began))

    def close(self) -> None:
        """Stop the thread and wait for it (a pass ends within one chunk)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._views = []
        self._keep = None
