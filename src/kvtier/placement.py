"""Where the pool's index lives, behind one interface the connector uses.

The scheduler half of the connector (connector/scheduler.py) talks to a
:class:`Placement` and never asks which one it has:

* :class:`EmbeddedPlacement`: the store and its tiers inside the vLLM
  instance's own scheduler process (``backend: embedded``, the default for
  a lone instance);
* :class:`kvtier.pool.client.PoolPlacement`: the node's meta service
  (``backend: pool`` or ``memcache``), over a local socket; the service
  holds the same store (:func:`open_store` builds it on both sides).

Every call keeps the store's meaning (store.py): ``probe``, ``promote``,
``pin``, ``prepare_save``, ``complete_step``, ``abandon_saves``,
``discard``, ``doom_pending``. ``reset`` forgets what this instance has in
flight and, embedded, everything the store holds (a pool shared with other
instances keeps their blocks: the instance's new key seed alone keeps it
from matching its old blocks). A placement that cannot answer (a meta
service gone) answers "miss": nothing found, nothing pinned, saves dropped.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Iterable, Sequence
from typing import Protocol

from kvtier.config import CLUSTER_LOOKUP_WAIT_S, ClusterConfig, KvtierConfig, PublishOn
from kvtier.hostmem import warm_interval_s
from kvtier.store import Probe, SaveSlots, TieredStore
from kvtier.tier.dram import DramTier, start_reaper
from kvtier.tier.ssd import SsdTier

log = logging.getLogger(__name__)


class Placement(Protocol):
    @property
    def arena_path(self) -> str: ...

    @property
    def num_slots(self) -> int: ...

    @property
    def epoch(self) -> int:
        """Changes when slots handed out before stop meaning anything (a
        new session with the meta service); constant in process."""
        ...

    def probe(self, keys: Sequence[bytes]) -> Probe: ...

    def promote(self, keys: Sequence[bytes]) -> int: ...

    def wait_progress(self, timeout_s: float) -> None: ...

    def pin(self, keys: Sequence[bytes], step: int) -> list[int | None]: ...

    def prepare_save(self, keys: Sequence[bytes], step: int) -> SaveSlots: ...

    def complete_step(self, step: int, failed_slots: Iterable[int] = (), all_failed: bool = False) -> None: ...

    def abandon_saves(self, step: int) -> int: ...

    def discard(self, keys: Iterable[bytes]) -> int: ...

    def doom_pending(self, after_step: int) -> int: ...

    def reset(self) -> int: ...

    def counters(self) -> dict[str, int]: ...

    def shutdown(self) -> None: ...


def open_store(cfg: KvtierConfig, arena: str, rank_bytes: int, ranks: int, fingerprint: bytes,
               reaper: bool = True, tier: DramTier | None = None,
               cluster: ClusterConfig | None = None, ready_index: bool = False) -> TieredStore:
    """Create the DRAM arena at ``arena`` (or use ``tier``, an adopted one),
    open the SSD tier if configured, and return the store over them.

    ``cluster``: the cluster tier's settings (the node pool's service only):
    the store gets a Mooncake client over its arena, which joins the
    cluster's master in the background (kvtier/cluster/client.py).

    The arena's pages are read every ``cfg.kv_warm_interval_s``
    (:meth:`DramTier.keep_warm`, :func:`kvtier.hostmem.warm_interval_s`)
    while it is open.

    ``ready_index``: the store keeps one (the meta service's: its probes
    come as one buffer of keys, see kvtier/ready_index.py).

    ``reaper``: start the process that removes the arena when its owner
    dies (an engine); a meta service keeps its arena for a restart to adopt.
    What was created is removed again if a later part fails; a ``tier``
    given stays the caller's (open).
    """
    made = tier is None
    if tier is None:
        tier = DramTier.create(arena, cfg.dram_size_bytes, rank_bytes, ranks)
    if reaper:
        try:
            # vLLM stops its engine core with SIGKILL right after SIGTERM: the
            # reaper, not shutdown(), is what removes the arena on most stops.
            start_reaper(tier)
        except (OSError, subprocess.SubprocessError) as err:
            log.warning("kvtier: cannot start the process that removes %s after this engine exits (%s); "
                        "a later kvtier start removes it", tier.path, err)
    interval = warm_interval_s(cfg.kv_warm_interval_s)
    try:
        tier.keep_warm(interval)
        if interval > 0:
            log.info("kvtier: reading a byte of each page of the arena (%d MiB) every %g s, so that loads do not "
                     "read memory the host left cold", tier.mapped_range[1] >> 20, interval)
    except Exception as err:  # noqa: BLE001 - an optimisation; the store does not depend on it
        log.warning("kvtier: the arena %s is not kept warm: %s", tier.path, err)
    ssd = None
    recovered: list = []
    try:
        if cfg.ssd_paths:
            # A tier written under another geometry starts empty instead of
            # recovering blocks whose bytes would be misread.
            ssd, recovered = SsdTier.open(cfg.ssd_paths, cfg.ssd_size_bytes, tier.slot_stride,
                                          cfg.force_new_disk, fingerprint=fingerprint)
        remote = None
        if cluster is not None:
            from kvtier.cluster.client import MooncakeTier  # the kvtier[cluster] extra, only when configured

            remote = MooncakeTier(cluster, tier)
        return TieredStore(tier, cfg.evict_threshold_high, cfg.evict_threshold_low, ssd=ssd,
                           ssd_high_pct=cfg.ssd_evict_threshold_high,
                           ssd_low_pct=cfg.ssd_evict_threshold_low,
                           dram_watermark_pct=cfg.rewarm_dram_watermark,
                           io_threads=cfg.io_threads,
                           demote_queue_blocks=cfg.demote_queue_blocks,
                           recovered=recovered, cluster=remote,
                           publish_on_evict=cluster is not None and cluster.publish_on is PublishOn.EVICT,
                           cluster_timeout_s=cluster.timeout_s if cluster is not None else CLUSTER_LOOKUP_WAIT_S,
                           cluster_lookup_blocks=cluster.lookup_blocks if cluster is not None else 256,
                           stale_move_s=cfg.promote_timeout_s, ready_index=ready_index)
    except BaseException:
        if ssd is not None:
            ssd.discard()  # the files it created go too
        if made:
            tier.close()
        raise


def close_store(store: TieredStore) -> None:
    """Stop the store's I/O, close the SSD tier, then close (and, owner, remove) the arena."""
    try:
        store.close()
        if store.ssd is not None:
            store.ssd.close()
    finally:
        store.tier.close()


class EmbeddedPlacement:
    """The store in this process. Attributes it does not define are the store's."""

    def __init__(self, store: TieredStore) -> None:
        self.store = store

    def __getattr__(self, name: str) -> object:
        return getattr(self.store, name)

    @property
    def arena_path(self) -> str:
        return self.store.tier.path

    @property
    def num_slots(self) -> int:
        return self.store.tier.num_slots

    @property
    def epoch(self) -> int:
        return 0

    def probe(self, keys: Sequence[bytes]) -> Probe:
        return self.store.probe(keys)

    def promote(self, keys: Sequence[bytes]) -> int:
        return self.store.promote(keys)

    def wait_progress(self, timeout_s: float) -> None:
        self.store.wait_progress(timeout_s)

    def pin(self, keys: Sequence[bytes], step: int) -> list[int | None]:
        return self.store.pin(keys, step)

    def prepare_save(self, keys: Sequence[bytes], step: int) -> SaveSlots:
        return self.store.prepare_save(keys, step)

    def complete_step(self, step: int, failed_slots: Iterable[int] = (), all_failed: bool = False) -> None:
        self.store.complete_step(step, failed_slots=range(self.num_slots) if all_failed else failed_slots)

    def abandon_saves(self, step: int) -> int:
        return self.store.abandon_saves(step)

    def discard(self, keys: Iterable[bytes]) -> int:
        return self.store.discard(keys)

    def doom_pending(self, after_step: int) -> int:
        return self.store.doom_pending(after_step)

    def reset(self) -> int:
        return self.store.clear()

    def counters(self) -> dict[str, int]:
        return self.store.counters()

    def shutdown(self) -> None:
        close_store(self.store)
