"""The sampling-side cores of four methods (issue 33): DRIVE's two RL stages (prompt_sampler=drive,
algorithm=drive), PVPO's pre-sampling filter, ground-truth injection and refreshed anchor, INTELLECT-2's
offline and online difficulty filters and length-target reward, and LSPO's filter on the step's own
rollouts. Each against hand-made statistics, groups and closed forms."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))  # conftest and test_curricula, also as a script
from conftest import compose_config
from test_curricula import graded

from rlbench.config.typed import typed_config
from rlbench.dataset.base import Problem
from rlbench.rollout.engines.base import SamplingParams
from rlbench.rollout.strategy import RolloutSetup
from rlbench.training.curricula import Curriculum, HardFocusPrompts, PromptSampler

# ------------------------------------------------------------------------------------------ DRIVE


def step_context(n: int) -> SimpleNamespace:
    """The two fields of the step context a stage changes: the sampling parameters and the strategy's setup."""
    params = SamplingParams(1.0, 1.0, 8)
    return SimpleNamespace(params=params, strategy=SimpleNamespace(setup=RolloutSetup(None, n, params, None)))


def drive_trainer(tmp_path, steps: int):
    cfg = compose_config(["algorithm=drive", "experiment=smoke", f"trainer.steps={steps}", "trainer.prompts_per_step=4"],
                         tmp_path / "run")
    return typed_config(cfg).trainer


def accuracy_of(uid: str) -> int:
    """Correct responses out of 4 for prompt ``uid``: a fixed difficulty per prompt, 0..4."""
    return int(uid) % 5


def train_stage_one(curriculum: Curriculum, ctx, steps: int) -> set[str]:
    """Steps 1..steps of the curriculum, each prompt graded with :func:`accuracy_of` correct of 4; returns the
    prompts seen."""
    seen = set()
    for step in range(1, steps + 1):
        prompts = curriculum.prompts(step, ctx)
        seen |= {p.uid for p in prompts}
        correct = [[1] * accuracy_of(p.uid) + [0] * (4 - accuracy_of(p.uid)) for p in prompts]
        curriculum.observe(step, graded(prompts, [[3] * 4 for _ in prompts], correct))
        curriculum.end_step(step)
    return seen


def test_drive_switches_at_the_configured_step_and_keeps_the_hardest_measured_prompts(tmp_path):
    trainer = drive_trainer(tmp_path, steps=8)
    [stage] = trainer.stages
    assert stage["at"] == 5  # the first step of the second half of 8 (rlbench.halfway)
    problems = [Problem(str(i), f"q{i}", "a") for i in range(40)]
    curriculum = Curriculum(trainer, 0, problems)
    ctx = step_context(n=8)
    seen = train_stage_one(curriculum, ctx, steps=4)  # stage 1: uniform shuffled passes, n = 8
    assert isinstance(curriculum.sampler, PromptSampler) and ctx.strategy.setup.n == 8
    assert len(seen) == 16  # 4 steps x 4 prompts, the first pass of the shuffled order: no repeats

    prompts = curriculum.prompts(5, ctx)  # the switch
    assert ctx.strategy.setup.n == 64
    assert isinstance(curriculum.sampler, HardFocusPrompts)
    # the pool: ceil(0.5 * 40) = 20 prompts; first every measured one with pass rate <= 0.8 (accuracy 0..3 of 4),
    # hardest first; then the measured ones above 0.8, then unmeasured ones, up to 20
    measured_hard = {uid for uid in seen if accuracy_of(uid) <= 3}
    measured_easy = {uid for uid in seen if accuracy_of(uid) == 4}
    pool = {p.uid for p in curriculum.sampler.pool}
    assert len(pool) == 20
    assert measured_hard <= pool
    assert pool - measured_hard <= measured_easy | {p.uid for p in problems if p.uid not in seen}
    if len(measured_hard) + len(measured_easy) >= 20:
        assert pool <= seen  # unmeasured prompts only fill a pool the measured ones cannot
    assert {p.uid for p in prompts} <= pool


def test_drive_stage_two_pool_is_the_hardest_half_by_measured_accuracy(tmp_path):
    """Every prompt measured before the switch and no floor on the pool: exactly the hardest half stays,
    and the next phase cut keeps the hardest of what is left."""
    stage = "[{at:3,rollout:{n:64},trainer:{prompt_sampler:{name:hard_focus,hard_focus:{phase_steps:2,min_pool:1}}}}]"
    cfg = compose_config(["algorithm=drive", "experiment=smoke", "trainer.steps=6", "trainer.prompts_per_step=4",
                          f"trainer.stages={stage}"], tmp_path / "run")
    problems = [Problem(str(i), f"q{i}", "a") for i in range(8)]
    curriculum = Curriculum(typed_config(cfg).trainer, 0, problems)
    ctx = step_context(n=8)
    train_stage_one(curriculum, ctx, steps=2)  # 2 steps x 4 prompts: each of the 8 once
    curriculum.prompts(3, ctx)
    # pass rates of uids 0..7: 0, 1/4, 2/4, 3/4, 1, 0, 1/4, 2/4: the hardest 4 are 0 and 5 (0), 1 and 6 (1/4)
    assert [p.uid for p in curriculum.sampler.pool] == ["0", "1", "5", "6"]
    curriculum.end_step(3)
    assert len(curriculum.sampler.pool) == 4  # a phase is 2 steps of stage 2: no cut after its first step
    curriculum.end_step(4)
    assert [p.uid for p in curriculum.sampler.pool] == ["0", "5"]


def test_drive_resume_after_the_switch_continues_with_the_stage_two_sampler(tmp_path):
    trainer = drive_trainer(tmp_path, steps=8)
    problems = [Problem(str(i), f"q{i}", "a") for i in range(40)]
    curriculum = Curriculum(trainer, 0, problems)
    train_stage_one(curriculum, step_context(n=8), steps=6)  # past the switch at step 5
    resumed, ctx = Curriculum(trainer, 0, problems), step_context(n=8)
    resumed.load_state_dict(curriculum.state_dict(), ctx, step=6)
    assert isinstance(resumed.sampler, HardFocusPrompts) and ctx.strategy.setup.n == 64
    assert [p.uid for p in resumed.sampler.pool] == [p.uid for p in curriculum.sampler.pool]
    assert [p.uid for p in resumed.prompts(7, ctx)] == [p.uid for p in curriculum.prompts(7, step_context(n=64))]
