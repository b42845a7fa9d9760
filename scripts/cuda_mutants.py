"""Shows that tests/cuda catches a missing wait: each mutant is a copy of
src/ with one wait of the CUDA copy path removed, and the test written for
that wait must fail on it. Run on a machine with an NVIDIA GPU, from the
repository's root: ``python3 scripts/cuda_mutants.py`` (about a minute).
Prints one line a mutant and ``mutants killed N/5``; exits 0 when all are."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

COPY = "src/kvtier/connector/copy.py"
WORKER = "src/kvtier/connector/worker.py"
WAIT = "self.stream.wait_stream(torch.cuda.current_stream(self.device))"
# name -> (file, text, its n-th occurrence, replacement, the test that must fail)
MUTANTS = {
    "vLLM's stream does not wait for the saves": (
        COPY, "torch.cuda.current_stream(self.device).wait_stream(self.stream)", 1, "pass", "next_step_writes"),
    "a load does not wait for vLLM's stream": (COPY, WAIT, 1, "pass", "lands_after_the_writes"),
    "a save does not wait for the attention": (COPY, WAIT, 2, "pass", "save_reads_the_layer_after"),
    "wait_for_layer_load waits for nothing": (
        COPY, "torch.cuda.current_stream(self.device).wait_event(ready)", 1, "pass", "read_only_after_its_load"),
    "the checksum pass does not wait for the copies": (WORKER, "copied.synchronize()", 1, "pass",
                                                       "reused_before_its_dma"),
}


def main() -> int:
    root = os.getcwd()
    killed = 0
    for name, (path, text, nth, replacement, test) in MUTANTS.items():
        with tempfile.TemporaryDirectory(prefix="kvtier-mutant-") as tmp:
            shutil.copytree(os.path.join(root, "src"), os.path.join(tmp, "src"))
            target = os.path.join(tmp, path)
            source = open(target).read()
            at = -1
            for _ in range(nth):
                at = source.index(text, at + 1)
            with open(target, "w") as f:
                f.write(source[:at] + replacement + source[at + len(text):])
            env = dict(os.environ, PYTHONPATH=os.path.join(tmp, "src") + os.pathsep + root)
            rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/cuda",
                                  "-k", test], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        caught = rc == 1  # tests ran and failed (5: none collected; 2-4: pytest itself failed)
        killed += caught
        print(f"mutant '{name}': pytest tests/cuda -k {test} exit {rc}: {'killed' if caught else 'SURVIVED'}",
              flush=True)
    print(f"mutants killed {killed}/{len(MUTANTS)}")
    return 0 if killed == len(MUTANTS) else 1


if __name__ == "__main__":
    sys.exit(main())
