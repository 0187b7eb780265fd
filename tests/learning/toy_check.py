"""The learning check of an algorithm preset, shared by tests/learning and bench/learning_tier.py.

A preset's check runs ``experiment=toy_learning/<preset>`` (conf/experiment/toy_learning/: a tiny random
model whose reward is the share of even token ids in its response; the file holds the preset's toy
budget) through the real runner, once per seed, and once, on the first seed, as its negative control:
the same preset with no parameter change (``trainer.lr`` -> 1e-12; a schedule that takes no optimizer
step, TRPO, gets ``max_kl`` -> 1e-12 instead, with one CG iteration and one line-search try, since a
step bounded by 1e-12 nats is no step whatever its direction). Without parameter change a run's rewards
are sampling noise, the same for every seed in distribution; one control run per preset keeps the tier
within its time budget (the learners' seeds are what the medians need).

Criterion, on each run's per-step mean outcome r_1..r_S: the grader's reward before reward shaping (the
task is what must be learned; Thinkless' mode table and DAPO's length penalty are means to it), and with
dynamic sampling the mean over all the responses generated (the trained batch's mean is biased by the
group selection):

    peak rise = max_w mean(r_w .. r_w+3) - mean(r_1 .. r_4)     the best 4-step window against the first 4
    end rise  = mean(r_S-3 .. r_S) - mean(r_1 .. r_4)           the end against the start

A preset learns when, over the seeds, median(peak rise) exceeds the control's peak rise by
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
END_FLOOR = -0.02  # median end rise: the end is not below the start (by more than noise)
DEFAULT_SEEDS = (0, 1, 2)
CONTROL_SEEDS = 1  # control runs per preset, on the first seeds of the set
ROOT = Path(__file__).resolve().parents[2]
TOY_DIR = ROOT / "conf" / "experiment" / "toy_learning"


def seeds_from_env() -> tuple[int, ...]:
    """RLBENCH_LEARNING_SEEDS=10,11,12 runs the tier on another seed set (at least 3 seeds)."""
    raw = os.environ.get("RLBENCH_LEARNING_SEEDS")
    seeds = tuple(int(s) for s in raw.split(",")) if raw else DEFAULT_SEEDS
    if len(seeds) < 3:
        raise ValueError(f"RLBENCH_LEARNING_SEEDS needs at least 3 seeds, got {seeds}")
    return seeds


def rollouts_checked_by_presets() -> set[str]:
    """Rollout files the algorithm presets' own checks run: iid (every preset's default), every file an
    algorithm preset selects (dapo: dynamic_sampling; rlep, exgrpo, ar3po: their replay rollouts) and
    the rollout files those build on (their ``defaults``). Every other strategy has its own check:
    grpo with rollout=<strategy>."""
    import yaml

    def bases(name: str) -> set[str]:
        path = ROOT / "conf" / "rollout" / f"{name}.yaml"
        defaults = (yaml.safe_load(path.read_text()) or {}).get("defaults", []) if path.exists() else []
        found = {name}
        for entry in defaults:
            if isinstance(entry, str) and entry != "_self_":
                found |= bases(entry)
        return found

    checked = bases("iid")
    for path in (ROOT / "conf" / "algorithm").glob("*.yaml"):
        for entry in (yaml.safe_load(path.read_text()) or {}).get("defaults", []):
            if isinstance(entry, dict):
                for key, value in entry.items():
                    if key.startswith("override /rollout"):
                        checked |= bases(value)
    return checked


# Strategies the toy cannot judge, with the measurement that says why (docs/testing.md).
ROLLOUT_STRATEGIES_WITHOUT_TOY_CHECK = {
    # LSPO's length filter on dynamic sampling: the toy's responses all have 8 tokens (no EOS), so every
    # quantile is 8 and the filter keeps every informative group; grpo with rollout=lspo (max_rounds 2) gave, on
    # seeds 0-2 and the control (2026-12-04), the per-step curves of intellect2's check exactly (peak rise
    # +0.302, +0.202, +0.459; control +0.005): what it runs is dynamic sampling, which dapo and intellect2 check.
    "lspo": "every toy response has 8 tokens, so the length filter keeps every group",
    # MOTIF rewards a first-round response by the final-round accuracy of the rounds that continue from its
    # progress; on the toy the next round's tokens barely depend on the first round's, so the reward carries
    # no signal about the trained tokens: corr(first-round toy reward, MOTIF reward) = 0.09 on average over
    # seeds 0-3 (8 continuations, 4 prompts x 8), and 3 seeds x 16 steps gave median peak rise +0.022 against
    # the control's +0.035.
    "multiround": "the toy's later rounds do not depend on the first round",
    # training_free_grpo's rollout; see ALGORITHM_PRESETS_WITHOUT_TOY_CHECK
    "experience_library": "the toy's random model does not follow in-context examples",
    # rollout=offline samples nothing: the per-step rewards the criterion reads are those of the file's fixed
    # responses, not of the policy. tests/test_preference_offline.py trains DPO on a generated file and checks
    # that the same pairs' loss falls and their ranking turns right (preference_accuracy > 0.5 after 3 steps).
    "offline": "its per-step rewards are the file's, not the policy's samples",
    # RLEP's first run replays nothing (replay.per_group 0): it trains as rollout=iid, which grpo's check covers,
    # and writes its pool file; tests/test_replay_cores.py runs both phases from the command line.
    "replay_rlep_collect": "it trains as rollout=iid (grpo's check) and only writes the pool",
}


# Algorithm presets the toy cannot judge, with the measurement that says why (docs/testing.md).
ALGORITHM_PRESETS_WITHOUT_TOY_CHECK = {
    # Training-Free GRPO changes no weight: it learns only if the policy follows in-context examples. The
    # toy's random tiny model does not: with the library holding the 4 best responses (max_items 4,
    # max_chars 120), 3 seeds x 16 steps gave median peak rise -0.005 (seeds 0,1,2: -0.005, -0.004, -0.021)
    # and end rise -0.047 against the empty library's peak rise +0.044 (measured 2026-12-02,
    # OMP_NUM_THREADS=1; about 12 CPU-s per run). With the paper's summariser (contrast: lessons per group, then
    # one library update call per batch, since 2026-12-06) the random model writes lessons (161-175 per run)
    # but no valid library operation: `rlbench experiment=toy_learning/grpo algorithm=training_free_grpo
    # seed=S` kept the library empty on seeds 0,1,2 (every one of 64 groups summarised, 76-96 lines of the 16
    # update answers counted in library_invalid_ops per run), peak rise +0.009, +0.019, +0.056 (median +0.019;
    # end rise -0.045, -0.025, -0.014) against the control's (max_items 0) +0.040: the runs differ from it only
    # by the random draws the model calls use (11-16 CPU-s per run).
    # tests/test_training_free_grpo.py checks both update rules, the contrast summariser on a scripted
    # engine and that the prompts change with the library on a policy that copies its examples.
    "training_free_grpo": "the toy's random model does not follow in-context examples",
    # OTR's expected gradient is pi(y*) grad log pi(y*): it needs the policy to sample the reference token.
    # On the earlier toy the references were random even ids of the 49152-token vocabulary: pi(y*) measured 2e-10..4e-8
    # (initializer_range 1.0) and 2.0e-5 (0.02, near uniform) on seed 0, so K = 8 samples never matched
    # (loss and gradient exactly 0 over 16 steps) and K = 2048 matched 1.5e-5 of the time (peak monitored
    # outcome within noise: 0.418..0.582, no trend). `rlbench experiment=toy_learning/grpo algorithm=otr
    # guidance=even_tokens rollout.references.monitor_n=8` repeats it. On the 512-id toy (2026-12-02) it does
    # not learn either: seeds 0-2 peak rise +0.132 / +0.061 / +0.042 (median +0.061) against the control's +0.040.
    # QRPO online takes its quantiles among the group's own samples (no separate pi_ref samples yet), so they are
    # uniform whatever the policy learnt and the regression mostly lowers the responses below the best. Margins
    # (median peak rise - control - 0.05; 2026-12-04, AMD EPYC, 1 thread) on seeds 0-2: beta 0.01 -0.012, 0.03
    # -0.024, 0.05 -0.004, 0.1 +0.032, 0.2 +0.030 (end rise -0.023), 1.0 +0.003; ties at_most -0.003; lr 2e-2
    # -0.012; n 16 -0.040; seeds 3-5 at beta 0.1: -0.025. A check that passes on one seed set and fails on the
    # next would fail on another CPU. tests/test_qrpo.py checks the tabular optimum and that offline QRPO's
    # loss falls on a fixed file (with its negative control, lr 1e-12).
    # With the group as the reference set (reference_samples=0) those margins stay within noise; with the preset's
    # K = 8 pi_ref samples per prompt (2026-12-05, 1 thread; median peak rise - control - 0.05): beta 0.01 -0.001,
    # 0.03 +0.024 (seeds 3-5: +0.019), 0.1 +0.011 (median end rise -0.022: fails), 0.3 -0.004; beta 0.03 at lr 2e-2
    # -0.054. The responses soon beat every pi_ref sample (quantile 1), after which the regression only holds them
    # there: +0.02 is too thin a margin for a check that must pass on any CPU.
    "qrpo": "its margin over the control is +0.02 at best on the toy (the quantiles saturate at 1 against pi_ref's samples)",
    "otr": "the toy's reference tokens have probability ~1/vocab under the policy, so one-token rollouts never match",
    # RTO needs pi_dpo, a checkpoint a previous algorithm=dpo run saved from the same initial policy: a toy run is one
    # stage. tests/test_rto.py::test_dense_dpo_reward_alone_trains_the_policy_towards_pi_dpo runs both stages on the
    # toy (the dense reward's return rises, its lr-1e-12 control does not) and notes the toy reward's margin.
    "rto": "it needs a DPO checkpoint from an earlier run (two stages); tests/test_rto.py runs both on the toy",
    # REFUEL: the random tiny model never answers user_sim's arithmetic (every reward 0), so it was measured on
    # env=gridworld (moves by initials, initializer_range 0.3, train_size 4, as gigpo's check; 2026-12-05, 2 shared
    # CPU cores, 1 thread). A branch's outcome is its future return from a random turn h, so the step's mean moves
    # with the h drawn as much as with the policy. Median peak rise (control: lr 1e-12, seed 0): 6 turns, n 8 x 4
    # prompts, seed 0 lr 2e-2 -0.000 (peak -0.031 with round_steps null, +0.023 at lr 4e-2); 16 prompts x n 2 (the
    # paper's pair): seeds 0-2 +0.094 / +0.023 / +0.203 (median +0.094) against the control's +0.055; size 2, 4 turns:
    # +0.141 / +0.008 / +0.008 (median +0.008) against +0.008. tests/test_refuel.py checks the loss's zero, shift
    # invariance, the turn-h gradient mask and the shared roll-in.
    "refuel": "its outcome is a future return from a random turn, which on the toy moves with h as much as with the policy",
    # ReTool (env=python_tool): the toy's random tiny model would have to write a closed ```python block and a
    # right boxed answer by chance (a fixed multi-token string such as "```python" in random text; an argument, not
    # a measured run: no toy run of this preset was made). tests/test_retool.py checks the preset's episodes.
    "retool": "the random tiny model never writes a closed code block and a right answer, so every reward is 0",
    # Multi-turn DAPO (env=code_repair; its rollout multi_turn_filtered has no check of its own either): a reward
    # needs an edit block holding the whole fixed file, closed, then RUN_TESTS, which random text never holds (an
    # argument, not a measured run). `rlbench algorithm=dapo_multi_turn experiment=smoke` gave every episode
    # ended_by=no_action, reward 0 (2026-12-05). tests/test_env_code_repair.py and tests/test_dapo_multi_turn.py
    # check the episodes, the masks, the loss and the filter with scripted policies.
    "dapo_multi_turn": "the random tiny model never writes a closed edit block with the fix and RUN_TESTS, so every reward is 0",
}


def rollout_presets() -> list[str]:
    """The rollout strategies (conf/rollout) with a learning check of their own."""
    skipped = rollouts_checked_by_presets() | set(ROLLOUT_STRATEGIES_WITHOUT_TOY_CHECK)
    return sorted(p.stem for p in (ROOT / "conf" / "rollout").glob("*.yaml") if p.stem not in skipped)


def all_presets() -> list[str]:
    """Every learning check: the algorithm presets (conf/algorithm) but ALGORITHM_PRESETS_WITHOUT_TOY_CHECK,
    and :func:`rollout_presets`."""
    algorithms = [p.stem for p in (ROOT / "conf" / "algorithm").glob("*.yaml") if p.stem not in ALGORITHM_PRESETS_WITHOUT_TOY_CHECK]
    return sorted(algorithms + rollout_presets())


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
    return [s.get("rollout_outcome_mean", s["outcome_mean"]) for s in steps]


def compose(overrides: list[str], output_dir: Path):
    """tests/conftest.py's compose_config, imported at call time so the table script needs no Hydra."""
    from conftest import compose_config

    return compose_config(overrides, output_dir)


def with_values(base, overrides: list[str]):
    """A copy of ``base`` (a composed config) with plain ``key=value`` overrides applied as Hydra applies them
    once the defaults list is composed (``ConfigLoaderImpl._apply_overrides_to_config``: in order,
    ``OmegaConf.update(..., merge=True)`` on the struct config), so ``with_values(compose(a), b)`` equals
    ``compose(a + b)`` (tests/learning/test_presets_learn.py checks it). A preset's check composes once and runs
    its seeds and control from the copy: Hydra's composition is about 0.2 CPU-s a run. Anything else (a group,
    ``+``/``~``/``++``, a sweep) changes the defaults list and is refused: compose those."""
    import copy

    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    cfg = copy.deepcopy(base)
    for override in OverridesParser.create().parse_overrides(list(overrides)):
        key = override.key_or_group
        group = (ROOT / "conf" / key).is_dir() or "/" in key or override.package is not None
        if group or override.is_add() or override.is_force_add() or override.is_delete() or override.is_sweep_override():
            raise ValueError(f"{override.input_line}: only plain key=value overrides of a composed config (compose it instead)")
        OmegaConf.update(cfg, key, override.value(), merge=True)
    return cfg


def toy_run(out: Path, preset: str, *overrides: str, base=None) -> Path:
    """One toy run of the preset through the real runner; returns its metrics.jsonl. ``base``: the preset's
    composed toy config (:func:`toy_config`), which plain ``key=value`` overrides then change (:func:`with_values`)."""
    from rlbench.runner import run

    if base is None:
        cfg = compose([f"experiment=toy_learning/{preset}", *overrides], out)
    else:
        cfg = with_values(base, [*overrides, f"output_dir={out}"])
    run(cfg)
    return out / "metrics.jsonl"


def toy_config(preset: str, scratch: Path):
    """``experiment=toy_learning/<preset>`` composed (its output_dir ``scratch``)."""
    return compose([f"experiment=toy_learning/{preset}"], scratch)


def control_overrides(base) -> list[str]:
    """No parameter change: lr -> 1e-12, or for a schedule without optimizer steps (TRPO) max_kl -> 1e-12.
    ``base``: the preset's composed toy config (:func:`toy_config`)."""
    from rlbench.algorithm import Algorithm
    from rlbench.config.typed import algorithm_settings, typed_config

    if Algorithm.from_config(algorithm_settings(typed_config(base).algorithm)).uses_optimizer:
        return ["trainer.lr=1e-12"]
    return ["algorithm.update.trpo.max_kl=1e-12", "algorithm.update.trpo.cg_iters=1",
            "algorithm.update.trpo.line_search_steps=1"]


def check_preset(preset: str, seeds, workdir: Path) -> tuple[list[list[float]], list[list[float]]]:
    """The per-step rewards of the preset's toy runs, one per seed, and of its negative control (the
    first CONTROL_SEEDS seeds), all from one composition of its toy config."""
    base = toy_config(preset, workdir / "compose")
    control = control_overrides(base)
    runs = [step_rewards(toy_run(workdir / f"learn{seed}", preset, f"seed={seed}", base=base)) for seed in seeds]
    controls = [step_rewards(toy_run(workdir / f"control{seed}", preset, f"seed={seed}", *control, base=base))
                for seed in seeds[:CONTROL_SEEDS]]
    return runs, controls


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

    def explain(self) -> str:
        fmt = lambda xs: "[" + ", ".join(f"{x:+.3f}" for x in xs) + "]"
        return (
            f"{self.preset} seeds {list(self.seeds)}: peak rise {fmt(self.peak)} (median {self.median_peak:+.3f}), "
            f"end rise {fmt(self.end)} (median {self.median_end:+.3f}); control peak rise {fmt(self.control_peak)} "
            f"(median {self.median_control_peak:+.3f}); needs median peak > control + {PEAK_MARGIN} "
            f"and median end >= {END_FLOOR}"
        )

    def record(self, threads: int, runs: list[list[float]], controls: list[list[float]]) -> dict:
        """The verdict with the per-step rewards behind it, and what could change float rounding."""
        row = asdict(self)
        row.update(threads=threads, runs=runs, controls=controls,
                   aten_cpu_capability=os.environ.get("ATEN_CPU_CAPABILITY", "native"), median_peak=self.median_peak, median_end=self.median_end,
                   median_control_peak=self.median_control_peak, learns=self.learns)
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
