"""The learning check of an algorithm preset, shared by tests/learning and bench/learning_tier.py.

A preset's check runs ``experiment=toy_learning/<preset>`` (conf/experiment/toy_learning/: a tiny random
model whose reward is the share of even token ids in its response; the file holds the preset's toy
budget) through the real runner, once per seed, and once per seed as its negative control: the same
preset with no parameter change (``trainer.lr`` -> 1e-12; a schedule that takes no optimizer step, TRPO,
gets ``max_kl`` -> 1e-12 instead).

Criterion, on each run's per-step mean reward r_1..r_S (with dynamic sampling, the mean over all the
responses generated, since the trained batch's mean is biased by the group selection):

    peak rise = max_w mean(r_w .. r_w+3) - mean(r_1 .. r_4)     the best 4-step window against the first 4
    end rise  = mean(r_S-3 .. r_S) - mean(r_1 .. r_4)           the end against the start

A preset learns when, over the seeds, median(peak rise) exceeds the control's median(peak rise) by
``PEAK_MARGIN`` and median(end rise) is at least ``END_FLOOR`` ("the end is not below the start"). The peak
window, not the last one, is compared because on this toy a curve that learns can drift back before the
last step (the policy collapses onto a few even tokens, and Adam at lr 1e-2 can overshoot); the control
takes the same maximum over windows, so the comparison is fair to noise.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

WINDOW = 4
PEAK_MARGIN = 0.05  # median peak rise above the control's median peak rise (measured: results/learning/)
END_FLOOR = 0.0  # median end rise: the end is not below the start
CONTROL_CEILING = 0.08  # the control's median peak rise (noise of the best of 13 windows)
DEFAULT_SEEDS = (0, 1, 2)
ROOT = Path(__file__).resolve().parents[2]
TOY_DIR = ROOT / "conf" / "experiment" / "toy_learning"


def seeds_from_env() -> tuple[int, ...]:
    """RLBENCH_LEARNING_SEEDS=10,11,12 runs the tier on another seed set (at least 3 seeds)."""
    raw = os.environ.get("RLBENCH_LEARNING_SEEDS")
    seeds = tuple(int(s) for s in raw.split(",")) if raw else DEFAULT_SEEDS
    if len(seeds) < 3:
        raise ValueError(f"RLBENCH_LEARNING_SEEDS needs at least 3 seeds, got {seeds}")
    return seeds


def all_presets() -> list[str]:
    return sorted(p.stem for p in (ROOT / "conf" / "algorithm").glob("*.yaml"))


def window_means(rewards: list[float]) -> list[float]:
    return [sum(rewards[i : i + WINDOW]) / WINDOW for i in range(len(rewards) - WINDOW + 1)]


def peak_rise(rewards: list[float]) -> float:
    means = window_means(rewards)
    return max(means[1:]) - means[0]


def end_rise(rewards: list[float]) -> float:
    means = window_means(rewards)
    return means[-1] - means[0]


def step_rewards(metrics_file: Path) -> list[float]:
    steps = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    return [s.get("rollout_reward_mean", s["reward_mean"]) for s in steps]


@dataclass
class Verdict:
    preset: str
    seeds: tuple[int, ...]
    peak: list[float]
    end: list[float]
    control_peak: list[float]
    control_end: list[float]

    @property
    def median_peak(self) -> float:
        return statistics.median(self.peak)

    @property
    def median_end(self) -> float:
        return statistics.median(self.end)

    @property
    def median_control_peak(self) -> float:
        return statistics.median(self.control_peak)

    @property
    def learns(self) -> bool:
        return self.median_peak > self.median_control_peak + PEAK_MARGIN and self.median_end >= END_FLOOR

    @property
    def control_is_flat(self) -> bool:
        """Without parameter change the curve is sampling noise: its median peak rise stays below
        CONTROL_CEILING (a control that rises is no control, e.g. a schedule that ignores the lr)."""
        return self.median_control_peak < CONTROL_CEILING

    def explain(self) -> str:
        fmt = lambda xs: "[" + ", ".join(f"{x:+.3f}" for x in xs) + "]"
        return (
            f"{self.preset} seeds {list(self.seeds)}: peak rise {fmt(self.peak)} (median {self.median_peak:+.3f}), "
            f"end rise {fmt(self.end)} (median {self.median_end:+.3f}); control peak rise {fmt(self.control_peak)} "
            f"(median {self.median_control_peak:+.3f}); needs median peak > control + {PEAK_MARGIN} "
            f"and median end >= {END_FLOOR}"
        )

    def record(self, threads: int) -> dict:
        row = asdict(self)
        row.update(threads=threads, median_peak=self.median_peak, median_end=self.median_end,
                   median_control_peak=self.median_control_peak, learns=self.learns,
                   control_is_flat=self.control_is_flat)
        return row


def judge(preset: str, seeds, runs: list[list[float]], controls: list[list[float]]) -> Verdict:
    return Verdict(
        preset=preset,
        seeds=tuple(seeds),
        peak=[peak_rise(r) for r in runs],
        end=[end_rise(r) for r in runs],
        control_peak=[peak_rise(r) for r in controls],
        control_end=[end_rise(r) for r in controls],
    )
