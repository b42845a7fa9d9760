"""Mutants of kvtier's failure paths: each must make the unit tests fail.

A test suite that passes on broken code proves nothing. Each mutant below
switches off one guard that stands between a bad block and a user's answer
(a checksum check, a discard, a refusal). For each, the repository is
copied to a temporary folder, the one change is applied to the copy, and the
unit tests of the failure paths run against it. A mutant the tests still
pass on "survived": a guard no test checks. The result goes into
docs/reliability.md.

    .venv/bin/python tests/mutants.py            # all mutants
    .venv/bin/python tests/mutants.py -k worker  # those whose name contains "worker"

Exit status 1 if any mutant survived, or if a mutant's text is no longer in
the source (the list must follow the code, never silently go stale).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Fast files first: each run stops at its first failure (-x).
TESTS = [
    "tests/unit/test_connector_guards.py", "tests/unit/test_connector_failsafe.py", "tests/unit/test_dram.py",
    "tests/unit/test_pool_service.py", "tests/unit/test_store.py", "tests/unit/test_store_sessions.py",
    "tests/unit/test_pool_restart.py", "tests/unit/test_store_ssd.py", "tests/unit/test_layout_copy.py",
    "tests/unit/test_connector_stats.py", "tests/unit/test_ssd.py", "tests/unit/test_config.py",
    "tests/unit/test_store_pressure.py",
]


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the repository
    old: str
    new: str


MUTANTS = [
    Mutant("worker: checksum of loaded blocks not checked", "src/kvtier/connector/worker.py",
           "                        return matches(i)\n", "                        return True\n"),
    Mutant("worker: slot header not checked before the copy", "src/kvtier/connector/worker.py",
           "for i, (c, ok) in enumerate(zip(plan.loads, sealed)):\n            if ok:",
           "for i, (c, ok) in enumerate(zip(plan.loads, sealed)):\n            if True:"),
    Mutant("worker: saves of a step with a failed load kept", "src/kvtier/connector/worker.py",
           "if self._step_load_failed or self._load_errors:", "if False:"),
    Mutant("scheduler: corrupt keys never discarded", "src/kvtier/connector/scheduler.py",
           "self.store.discard(report.corrupt_keys)", "pass"),
    Mutant("scheduler: saves after a failed load not doomed", "src/kvtier/connector/scheduler.py",
           "self.store.doom_pending(last)", "pass"),
    Mutant("scheduler: a step reported by fewer than all ranks accepted", "src/kvtier/connector/scheduler.py",
           "if total < self.ranks:", "if total < 1:"),
    Mutant("dram: data checksum not compared", "src/kvtier/tier/dram.py",
           "return not check_data or checksum(self.rank_view(slot, rank), key) == int(h[\"checksum\"][rank])",
           "return True"),
    Mutant("store: failed save slots published", "src/kvtier/store.py",
           "if e.slot in failed or e.doomed:", "if False:"),
    Mutant("ssd: data checksum not compared on read", "src/kvtier/tier/ssd.py",
           "return xxhash.xxh3_64_intdigest(out) == rec.checksum", "return True"),
    Mutant("pool: a dead instance's pins and unwritten saves kept", "src/kvtier/pool/service.py",
           "pins, pending = store.end_session(s.id, hold_until=time.monotonic() + self._grace_s)", "pass"),
    Mutant("pool: token not checked", "src/kvtier/pool/service.py",
           "if self.opts.token and not hmac.compare_digest(msg.token.encode(), self.opts.token.encode()):",
           "if False:"),
    Mutant("pool: key length not checked on the wire", "src/kvtier/pool/wire.py",
           "if keys is not None and len(keys) % KEY_BYTES:", "if False:"),
    Mutant("store: held slots never return to the free list", "src/kvtier/store.py",
           "                self._free.extend(slots)\n            return sum(len(x) for x in due)",
           "                pass\n            return sum(len(x) for x in due)"),
    Mutant("worker: a save sealed with the checksum of its slot", "src/kvtier/connector/worker.py",
           "checksum_runs(runs(blocks[i], part.data_ptr()), keys[i])", "checksum(part, keys[i])"),
    Mutant("config: checksums off accepted on a shared pool", "src/kvtier/config.py",
           "if self.backend.shared and not self.verify_checksums:", "if False:"),
    Mutant("dram: unpublished blocks adopted after a restart", "src/kvtier/tier/dram.py",
           'if key == empty or not h["published"] or not h["ready"][: self.ranks].all():',
           'if key == empty or not h["ready"][: self.ranks].all():'),
    Mutant("store: a block being saved counted by the lookup's fast path", "src/kvtier/store.py",
           "                odd.add(key)\n", ""),
    Mutant("store: a block to be freed once on SSD counted by the lookup's fast path", "src/kvtier/store.py",
           "                e.evict_after = True\n                self._odd.add(key)\n",
           "                e.evict_after = True\n"),
    Mutant("dram: a clear not counted (a copy across it passes its check)", "src/kvtier/tier/dram.py",
           "(_GEN.unpack_from(mm, at + _GEN_AT)[0] + 1)", "(_GEN.unpack_from(mm, at + _GEN_AT)[0] + 0)"),
    Mutant("dram: a cleared slot left published (adopted after a restart)", "src/kvtier/tier/dram.py",
           "        mm[at + _PUBLISHED_AT] = 0\n", ""),
    Mutant("store: a block not plain READY pinned or unpinned by the fast path", "src/kvtier/store.py",
           "        return entries, all(entries) and not (odd and any(map(odd.__contains__, keys)))\n",
           "        return entries, all(entries)\n"),
]


def run_one(m: Mutant, python: str) -> tuple[str, float]:
    """'killed', 'survived' or 'stale' (the text to change is not in the source)."""
    src = os.path.join(ROOT, m.path)
    with open(src) as f:
        text = f.read()
    if text.count(m.old) != 1:
        return "stale", 0.0
    with tempfile.TemporaryDirectory(prefix="kvtier-mutant-") as tmp:
        for part in ("src", "tests", "pyproject.toml"):
            s, d = os.path.join(ROOT, part), os.path.join(tmp, part)
            (shutil.copytree if os.path.isdir(s) else shutil.copy)(s, d)
        with open(os.path.join(tmp, m.path), "w") as f:
            f.write(text.replace(m.old, m.new))
        env = dict(os.environ, PYTHONPATH=os.path.join(tmp, "src") + os.pathsep + tmp)
        # The copy, not the installed tree, must be what the tests import.
        where = subprocess.run([python, "-c", "import kvtier; print(kvtier.__file__)"], cwd=tmp, env=env,
                               capture_output=True, text=True, check=True).stdout.strip()
        if not where.startswith(tmp):
            raise SystemExit(f"the tests would import {where}, not the mutated copy")
        t0 = time.monotonic()
        r = subprocess.run([python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *TESTS], cwd=tmp,
                           env=env, capture_output=True, text=True)
        return ("survived" if r.returncode == 0 else "killed"), time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-k", default="", help="only mutants whose name contains this text")
    args = ap.parse_args()
    bad = 0
    print("| mutant | result |\n|---|---|")
    for m in MUTANTS:
        if args.k not in m.name:
            continue
        result, seconds = run_one(m, sys.executable)
        bad += result != "killed"
        print(f"| {m.name} | {result} ({seconds:.0f} s) |", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
