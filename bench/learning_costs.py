"""What one toy run of each preset costs: CPU seconds of ``experiment=toy_learning/<preset>`` (seed 0, one
torch thread, imports warmed), written to results/learning/run_seconds.json.

The learning tier (tests/conftest.py) starts its most expensive checks first, so that its two
workers end together instead of one waiting on TRPO; the figures only order the tests, nothing asserts on
them. Re-measure the presets whose toy budget changed:

    OMP_NUM_THREADS=1 .venv/bin/python bench/learning_costs.py              # every preset (~10 min)
    OMP_NUM_THREADS=1 .venv/bin/python bench/learning_costs.py trpo mdpo    # these, kept beside the rest

CPU seconds, not wall: a figure taken beside other work stays close to what an idle machine shows.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "learning")]
OUT = ROOT / "results" / "learning" / "run_seconds.json"


def main(presets: list[str]) -> None:
    import tempfile

    import torch

    from conftest import keep_freed_memory
    from rlbench.utils import atomic_write_json
    from toy_check import all_presets, toy_run

    keep_freed_memory()  # as in the test session (tests/conftest.py)
    torch.set_num_threads(1)
    logging.disable(logging.WARNING)
    presets = presets or all_presets()
    seconds = json.loads(OUT.read_text()) if OUT.exists() else {}
    with tempfile.TemporaryDirectory() as scratch:
        toy_run(Path(scratch) / "warm-up", presets[0], "seed=0", "trainer.steps=1")  # imports, first-call costs
        start = time.time()
        for i, preset in enumerate(presets):
            cpu = time.process_time()
            toy_run(Path(scratch) / preset, preset, "seed=0")
            seconds[preset] = round(time.process_time() - cpu, 1)
            elapsed = time.time() - start
            eta = elapsed / (i + 1) * (len(presets) - i - 1)
            print(f"[{i + 1}/{len(presets)}] {preset}: {seconds[preset]} s CPU  (elapsed {elapsed:.0f} s, ETA {eta:.0f} s)",
                  flush=True)
            atomic_write_json(OUT, dict(sorted(seconds.items())))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main(sys.argv[1:])
