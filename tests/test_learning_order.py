"""The learning tier starts its most expensive checks first (tests/conftest.py, from
results/learning/run_seconds.json): the collected order of tests/learning follows the expected cost."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT, RUN_SECONDS, TOY_RUNS_PER_TEST, schedule_key


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


class FakeItem:
    """What the ordering reads of a collected test: its markers, parameters and function name."""

    def __init__(self, name: str, markers: tuple[str, ...] = (), preset: str | None = None):
        self.name, self.originalname, self.markers = name, name.partition("[")[0], markers
        if preset is not None:
            self.callspec = type("CallSpec", (), {"params": {"preset": preset}})()

    def get_closest_marker(self, marker: str):
        return marker if marker in self.markers else None


def test_integration_tests_come_after_the_learning_checks_and_before_the_unit_tests():
    learns = "test_preset_learns_and_its_control_does_not"
    items = [FakeItem("test_unit_a"), FakeItem("test_cli", ("slow",)), FakeItem(f"{learns}[cheap]", ("learning",), "cheap"),
             FakeItem("test_unit_b"), FakeItem(f"{learns}[dear]", ("learning",), "dear"), FakeItem("test_sweep", ("slow",))]
    seconds = {"cheap": 1.0, "dear": 10.0}
    ordered = sorted(items, key=lambda item: schedule_key(item, seconds))
    assert [item.name for item in ordered] == [f"{learns}[dear]", f"{learns}[cheap]", "test_cli", "test_sweep",
                                               "test_unit_a", "test_unit_b"]
