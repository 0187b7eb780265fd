"""The learning tier starts its most expensive checks first (tests/conftest.py, from
results/learning/run_seconds.json): the collected order of tests/learning follows the expected cost."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT, RUN_SECONDS, TOY_RUNS_PER_TEST


def test_learning_checks_are_collected_most_expensive_first():
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "tests/learning"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    seconds = json.loads(RUN_SECONDS.read_text())
    costs = []
    for test_id in ids:
        name, _, param = test_id.split("::")[-1].partition("[")
        costs.append(TOY_RUNS_PER_TEST.get(name, 0.0) * seconds.get(param.rstrip("]"), 0.0) if param else 0.0)
    assert costs and costs[0] == max(costs)
    assert costs == sorted(costs, reverse=True)
