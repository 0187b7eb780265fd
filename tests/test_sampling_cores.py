"""The sampling-side cores of four methods (issue 33): DRIVE's two RL stages (prompt_sampler=drive,
algorithm=drive), PVPO's pre-sampling filter, ground-truth injection and refreshed anchor, INTELLECT-2's
offline and online difficulty filters and length-target reward, and LSPO's filter on the step's own
rollouts. Each against hand-made statistics, groups and closed forms."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # conftest and test_curricula, also as a script
from conftest import algorithm_from, compose_config
from test_curricula import graded
from conftest import CharTokenizer as ChatCharTokenizer
from test_guidance import CharTokenizer

from rlbench.algorithm.shaping import length_target, length_target_penalty
from rlbench.config.schema import DifficultyFilterConfig
from rlbench.config.typed import rollout_config, typed_config
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.guidance import GuidanceLibrary, Trace
from rlbench.reward.toy import EvenTokenReward
from rlbench.rollout import GroupSampler, make_strategy
from rlbench.rollout.engines.base import Completion, SamplingParams
from rlbench.rollout.strategy import RolloutSetup
from rlbench.training.advantage_inputs import (
    AdvantageInputSources,
    BaselineOptions,
    BaselineRewards,
    ReferenceAnchor,
)
from rlbench.training.curricula import (
    Curriculum,
    HardFocusPrompts,
    PromptSampler,
    difficulty_filter,
)
from rlbench.training.prompt_stats import PromptStatsStore
from rlbench.training.stages import entropy_change

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


#: a scripted entropy stream: falling over steps 1-6, then flat; entropy_change (window 5) at steps 10..15:
#: 0.375, 0.286, 0.194, 0.107, 0.038, 0 (below the preset's 0.02 from step 15 on)
ENTROPIES = [2.0, 1.8, 1.6, 1.4, 1.2] + [1.0] * 20
SWITCH = 18  # below 0.02 at steps 15, 16, 17 (for_steps 3): stage 2 starts at the step after


def train_stage_one(curriculum: Curriculum, ctx, steps: int, start: int = 1) -> set[str]:
    """Steps start..steps of the curriculum, each prompt graded with :func:`accuracy_of` correct of 4 and
    the step's entropy from ENTROPIES; returns the prompts seen."""
    seen = set()
    for step in range(start, steps + 1):
        prompts = curriculum.prompts(step, ctx)
        seen |= {p.uid for p in prompts}
        correct = [[1] * accuracy_of(p.uid) + [0] * (4 - accuracy_of(p.uid)) for p in prompts]
        curriculum.observe(step, graded(prompts, [[3] * 4 for _ in prompts], correct))
        curriculum.end_step(step)
        curriculum.watch({"entropy": ENTROPIES[step - 1]})
    return seen


def test_entropy_change_by_hand():
    """|mean of the last 5 - mean of the 5 before| / mean of the 5 before; infinite before 10 values."""
    assert entropy_change([1.0] * 9) == math.inf
    assert entropy_change([1.0] * 5 + [0.5] * 5) == pytest.approx(0.5)
    assert entropy_change([9.0] + [2.0] * 5 + [2.2] * 5) == pytest.approx(0.1)  # only the last 10 count
    assert [round(entropy_change(ENTROPIES[:t]), 3) for t in range(10, 16)] == [0.375, 0.286, 0.194, 0.107, 0.038, 0.0]


def test_drive_switches_on_the_entropy_plateau_and_keeps_the_hardest_measured_prompts(tmp_path):
    trainer = drive_trainer(tmp_path, steps=24)
    [stage] = trainer.stages
    assert dict(stage["when"]) == {"metric": "entropy_change", "below": 0.02, "for_steps": 3}
    problems = [Problem(str(i), f"q{i}", "a") for i in range(200)]
    curriculum = Curriculum(trainer, 0, problems)
    ctx = step_context(n=8)
    seen = train_stage_one(curriculum, ctx, steps=SWITCH - 1)  # stage 1: uniform shuffled passes, n = 8
    assert isinstance(curriculum.sampler, PromptSampler) and ctx.strategy.setup.n == 8
    assert curriculum.entered_at == [] and curriculum.metrics()["entropy_change"] == 0.0
    assert len(seen) == 4 * (SWITCH - 1)  # the first pass of the shuffled order: no repeats

    prompts = curriculum.prompts(SWITCH, ctx)  # the switch: the plateau held for 3 steps
    assert curriculum.entered_at == [SWITCH] and ctx.strategy.setup.n == 64
    assert isinstance(curriculum.sampler, HardFocusPrompts)
    # the pool: ceil(0.5 * 200) = 100 prompts; first every measured one with pass rate <= 0.8 (accuracy 0..3 of 4),
    # hardest first; then the measured ones above 0.8, then unmeasured ones, up to 100
    measured_hard = {uid for uid in seen if accuracy_of(uid) <= 3}
    measured_easy = {uid for uid in seen if accuracy_of(uid) == 4}
    pool = {p.uid for p in curriculum.sampler.pool}
    assert len(pool) == 100
    assert measured_hard <= pool
    assert pool - measured_hard <= measured_easy | {p.uid for p in problems if p.uid not in seen}
    assert {p.uid for p in prompts} <= pool


def test_drive_stays_in_stage_one_until_the_plateau_held_for_its_steps(tmp_path):
    """One step less of the plateau (an entropy rise at step 17 breaks the run of steps below 0.02): no switch."""
    curriculum = Curriculum(drive_trainer(tmp_path, steps=24), 0, [Problem(str(i), f"q{i}", "a") for i in range(40)])
    ctx = step_context(n=8)
    train_stage_one(curriculum, ctx, steps=16)
    curriculum.prompts(17, ctx)
    curriculum.watch({"entropy": 2.0})  # the last 5 steps' mean rises 20%
    curriculum.prompts(18, ctx)
    assert curriculum.entered_at == [] and ctx.strategy.setup.n == 8


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


@pytest.mark.parametrize("saved", [9, 16, SWITCH + 1])
def test_drive_resumed_before_during_or_after_the_plateau_switches_as_the_uninterrupted_run(tmp_path, saved):
    """A checkpoint before entropy_change is defined, while the plateau is being counted, and after the switch:
    the resumed curriculum enters stage 2 at the same step, with the same pool and prompts."""
    trainer = drive_trainer(tmp_path, steps=24)
    problems = [Problem(str(i), f"q{i}", "a") for i in range(40)]
    curriculum = Curriculum(trainer, 0, problems)
    train_stage_one(curriculum, step_context(n=8), steps=saved)
    state = curriculum.state_dict()
    train_stage_one(curriculum, step_context(n=8), steps=SWITCH + 1, start=saved + 1)
    resumed, ctx = Curriculum(trainer, 0, problems), step_context(n=8)
    resumed.load_state_dict(state, ctx, step=saved)
    train_stage_one(resumed, ctx, steps=SWITCH + 1, start=saved + 1)
    assert resumed.entered_at == curriculum.entered_at == [SWITCH]
    assert isinstance(resumed.sampler, HardFocusPrompts) and ctx.strategy.setup.n == 64
    assert [p.uid for p in resumed.sampler.pool] == [p.uid for p in curriculum.sampler.pool]
    assert [p.uid for p in resumed.prompts(SWITCH + 2, ctx)] == [p.uid for p in curriculum.prompts(SWITCH + 2, step_context(n=64))]


# ------------------------------------------------------------------------------------------- PVPO


class ScriptedEngine:
    """A stand-in for the model (deterministic): prompt id (u,) answers with even tokens (toy reward 1, correct)
    in the k-th sample of a request when ``solved(u, k)``, else odd tokens (reward 0); records its requests and
    the weights it was synced to."""

    def __init__(self, solved):
        self.solved, self.requests, self.synced = solved, [], []

    def generate(self, requests, params, generator=None):
        self.requests.append([(r.prompt_ids, r.n) for r in requests])
        return [[Completion(i, r.prompt_ids, [2, 4] if self.solved(r.prompt_ids[0], k) else [1, 3], [-0.1, -0.1], True)
                 for k in range(r.n)] for i, r in enumerate(requests)]

    def sync_weights(self, model):
        self.synced.append(model)


class UidSampler(GroupSampler):
    def encode(self, problems):
        return [(int(p.uid),) for p in problems]


def scripted_sampler(solved) -> UidSampler:
    return UidSampler(ScriptedEngine(solved), EvenTokenReward(), CharTokenizer(), {}, lambda rewards, _: rewards)


# the reference solves prompt 0 in every sample, prompt 1 in none, prompt 2 in every other one, prompt 3 in 1 of 4
REFERENCE_SOLVES = {0: lambda k: True, 1: lambda k: False, 2: lambda k: k % 2 == 0, 3: lambda k: k == 0}
PVPO_PROBLEMS = [Problem(str(u), f"q{u}", "a") for u in range(4)]


def reference_anchor(refresh_every=None, samples=4):
    sampler = scripted_sampler(lambda u, k: REFERENCE_SOLVES[u](k))
    options = BaselineOptions("reference", samples, refresh_every, presample=True)
    anchor = ReferenceAnchor(sampler, sampler.engine, "policy", "reference", options, SamplingParams(1.0, 1.0, 2),
                             torch.Generator().manual_seed(0))
    return anchor, sampler


def test_pvpo_presampling_drops_what_the_reference_always_solves_and_records_its_pass_rates():
    anchor, sampler = reference_anchor()
    stats = PromptStatsStore()
    sources = AdvantageInputSources({"baseline_rewards"}, [BaselineRewards(anchor)])
    kept = sources.before_training(PVPO_PROBLEMS, stats)
    assert [p.uid for p in kept] == ["1", "2", "3"]  # prompt 0: 4 of 4 right
    assert [stats.get(p.uid).reference_pass_rate for p in PVPO_PROBLEMS] == [1.0, 0.0, 0.5, 0.25]
    assert [anchor.cache.mean(p.uid) for p in PVPO_PROBLEMS] == [1.0, 0.0, 0.5, 0.25]  # V_ref: the mean reward
    assert sampler.engine.synced == ["reference", "policy"]  # sampled from the reference, then back
    assert sampler.engine.requests == [[((u,), 4) for u in range(4)]]  # one pass, before any step
    # a resumed run's sources (their state loaded) filter the same problems without sampling again
    resumed, resumed_sampler = reference_anchor()
    resumed.load_state_dict(anchor.state_dict())
    assert [p.uid for p in resumed.presample(PVPO_PROBLEMS, PromptStatsStore())] == ["1", "2", "3"]
    assert resumed_sampler.engine.requests == []


def test_pvpo_prompts_the_reference_always_solves_never_appear(tmp_path):
    anchor, _ = reference_anchor()
    stats = PromptStatsStore()
    kept = anchor.presample(PVPO_PROBLEMS, stats)
    cfg = compose_config(["algorithm=pvpo", "experiment=smoke", "trainer.steps=40", "trainer.prompts_per_step=2"],
                         tmp_path / "run")
    curriculum = Curriculum(typed_config(cfg).trainer, 0, kept, stats)
    drawn = [p.uid for step in range(1, 41) for p in curriculum.prompts(step, step_context(n=2))]
    assert "0" not in drawn and set(drawn) == {"1", "2", "3"}


def test_pvpo_everything_solved_by_the_reference_is_refused():
    anchor, _ = reference_anchor()
    with pytest.raises(ConfigError, match="solves every one of the 1 training problems"):
        anchor.presample([PVPO_PROBLEMS[0]], PromptStatsStore())


def test_pvpo_ground_truth_trajectory_only_for_prompts_the_reference_never_solved():
    library = GuidanceLibrary()
    for u in range(5):
        library.add(Trace(str(u), "", (2, 4), "dataset"))
    stats = PromptStatsStore()
    for uid, rate in {"0": 0.0, "1": 0.5, "2": 0.0, "3": 0.25}.items():  # prompt 4: never measured
        stats.set_reference(uid, rate)
    sampler = scripted_sampler(lambda u, k: False)  # the policy never solves anything
    setup = RolloutSetup(sampler, 4, SamplingParams(1.0, 1.0, 2), None, guidance=library, prompt_stats=stats)
    cfg = {"strategy": "mixed_traces", "n": 4, "mixed_traces": {"traces_per_group": 1, "when": "reference_unsolved"}}
    problems = [Problem(str(u), f"q{u}", "a") for u in range(5)]
    graded, metrics = make_strategy(rollout_config(cfg), setup).rollout(problems)
    # reference pass rate 0: 3 samples + the trajectory in place of the fourth; every other prompt: 4 samples
    assert sampler.engine.requests == [[((0,), 3), ((1,), 4), ((2,), 3), ((3,), 4), ((4,), 4)]]
    assert [[c.behaviour for c in group].count("dataset") for group in graded.groups] == [1, 0, 1, 0, 0]
    assert all(len(group) == 4 for group in graded.groups) and metrics["groups_with_trace"] == 2.0
    trace = graded.groups[0][-1]
    assert trace.off_policy == [1, 1] and trace.behaviour_logprobs == [0.0, 0.0]  # mu = 1: the source's probability unknown


def test_pvpo_anchor_is_refreshed_on_schedule():
    anchor, sampler = reference_anchor(refresh_every=2)
    anchor.presample(PVPO_PROBLEMS, PromptStatsStore())  # every anchor estimated at step 0
    policy = scripted_sampler(lambda u, k: True)
    batch = policy([PVPO_PROBLEMS[2]], 2, SamplingParams(1.0, 1.0, 2), None)
    generated = []
    for _ in range(5):  # training steps 1..5 (the anchor's steps 0..4)
        anchor(batch)
        generated.append(anchor.generated)
    # re-estimated 2 steps after its last estimate: at the anchor's steps 2 and 4
    assert generated == [0, 0, 4, 0, 4]
    assert len(sampler.engine.requests) == 3  # the pre-sampling pass and the two refreshes


def test_ground_truth_rollout_needs_pvpo_presampling(tmp_path):
    from rlbench.validation import validate_config

    cfg = compose_config(["algorithm=grpo", "rollout=ground_truth", "guidance=dataset", "experiment=smoke"], tmp_path / "a")
    with pytest.raises(ConfigError, match="when=reference_unsolved .* only PVPO's pre-sampling"):
        validate_config(cfg)
    validate_config(compose_config(["algorithm=pvpo", "experiment=smoke"], tmp_path / "b"))
    cfg = compose_config(["algorithm=pvpo", "experiment=smoke", "algorithm.baseline.presample=false"], tmp_path / "c")
    with pytest.raises(ConfigError, match="when=reference_unsolved"):
        validate_config(cfg)


# ------------------------------------------------------------------------------------- INTELLECT-2


def test_length_target_reward_in_closed_form():
    lengths = torch.tensor([0, 4, 8, 12, 8, 3])
    uids = ["0", "0", "0", "0", "1", "2"]
    # the draw of length_target(uid, [4, 8], seed 0): uid 0 -> 4, uids 1, 2 -> 8 (pinned: a change of the hash shows)
    assert [length_target(u, [4, 8]) for u in ("0", "1", "2")] == [4, 8, 8]
    reward = length_target_penalty(lengths, uids, targets=[4, 8], alpha=0.5)
    assert reward.tolist() == [-2.0, 0.0, -2.0, -4.0, 0.0, -2.5]  # -0.5 |L - L_target|
    assert reward[1] == reward[:4].max()  # the most at L = L_target
    with pytest.raises(ValueError, match="non-empty list"):
        length_target_penalty(lengths, uids, targets=[], alpha=0.5)
    with pytest.raises(ValueError, match="must contain"):
        length_target_penalty(lengths, uids, targets=[4], prompt="Think for N tokens.")


def test_length_targets_are_a_seeded_uniform_draw_per_prompt():
    uids = [str(u) for u in range(400)]
    draw = [length_target(u, [1000, 2000, 3000, 4000], seed=3) for u in uids]
    assert draw == [length_target(u, [1000, 2000, 3000, 4000], seed=3) for u in uids]  # same seed, same targets
    assert draw != [length_target(u, [1000, 2000, 3000, 4000], seed=4) for u in uids]  # another seed, another draw
    counts = [draw.count(t) for t in (1000, 2000, 3000, 4000)]
    assert all(60 <= c <= 140 for c in counts), counts  # 100 expected each (binomial sd 8.7)


def test_intellect2_prompt_carries_the_target_its_reward_reads(tmp_path):
    """Through the preset and the sampler: each prompt says its target, and every response of that prompt is
    rewarded towards the same target."""
    cfg = compose_config(["algorithm=intellect2", "experiment=smoke"], tmp_path / "run")
    algorithm = algorithm_from(cfg.algorithm)
    assert [(s.name, s.params) for s in algorithm.reward_shaping] == [("length_target", {
        "targets": [1000, 2000, 3000, 4000], "alpha": 0.001, "seed": 0,
        "prompt": "Think for {target} tokens before giving a response."})]
    sampler = GroupSampler(ScriptedEngine(lambda u, k: True), EvenTokenReward(), ChatCharTokenizer(), {},
                           algorithm.shape_rewards, prompt_instruction=algorithm.prompt_instruction)
    graded = sampler(PVPO_PROBLEMS, 2, SamplingParams(1.0, 1.0, 2), None)
    targets = [3000, 4000, 4000, 4000]  # length_target of uids 0-3, seed 0 (pinned)
    prompts = ["".join(map(chr, ids)) for ids, _ in sampler.engine.requests[0]]
    assert prompts == [f"q{u}\nThink for {t} tokens before giving a response.\n"
                       "Please reason step by step, and put your final answer within \\boxed{}." for u, t in enumerate(targets)]
    # 2 even tokens per response: outcome 1, length term -0.001 |2 - L_target|
    assert graded.rewards.tolist() == pytest.approx([1.0 - 0.001 * (t - 2) for t in targets for _ in range(2)])
    without = GroupSampler(ScriptedEngine(lambda u, k: True), EvenTokenReward(), ChatCharTokenizer(), {}, algorithm.shape_rewards)
    assert without.encode(PVPO_PROBLEMS[:1])[0] == tuple(map(ord, "q0\nPlease reason step by step, and put your final "
                                                                 "answer within \\boxed{}."))


def test_difficulty_filter_keeps_exactly_the_problems_in_the_band():
    # initial pass rates (4 samples): prompt 0 -> 1, 1 -> 0, 2 -> 1/2, 3 -> 1/4
    sampler = scripted_sampler(lambda u, k: REFERENCE_SOLVES[u](k))
    sample = lambda chunk: sampler(chunk, 4, SamplingParams(1.0, 1.0, 2), None)
    band = DifficultyFilterConfig(samples=4, min_pass_rate=0.25, max_pass_rate=0.75)
    stats = PromptStatsStore()
    assert [p.uid for p in difficulty_filter(PVPO_PROBLEMS, sample, stats, band)] == ["2", "3"]  # both ends inclusive
    assert [stats.get(p.uid).reference_pass_rate for p in PVPO_PROBLEMS] == [1.0, 0.0, 0.5, 0.25]
    # INTELLECT-2's band: drop 8 of 8 (and 4 of 4) solved, keep everything else
    again = difficulty_filter(PVPO_PROBLEMS, sample, stats, DifficultyFilterConfig(4, 0.0, 0.875))
    assert [p.uid for p in again] == ["1", "2", "3"]
    assert len(sampler.engine.requests) == 1  # rates already measured (as on resume): nothing sampled again
    with pytest.raises(ConfigError, match="none of the 4 training problems"):
        difficulty_filter(PVPO_PROBLEMS, sample, stats, DifficultyFilterConfig(4, 0.3, 0.4))


def test_intellect2_online_filter_drops_exactly_the_groups_without_signal(tmp_path):
    cfg = compose_config(["algorithm=intellect2", "experiment=smoke"], tmp_path / "run")
    assert cfg.rollout.strategy == "dynamic_sampling" and cfg.rollout.dynamic_sampling.metric == "correct"
    # the policy solves prompt 0 always, 1 never, 2 and 3 sometimes: only 2 and 3 are kept
    sampler = scripted_sampler(lambda u, k: REFERENCE_SOLVES[u](k))
    setup = RolloutSetup(sampler, 4, SamplingParams(1.0, 1.0, 2), None)
    graded, metrics = make_strategy(typed_config(cfg).rollout, setup).rollout(
        PVPO_PROBLEMS[:2] + PVPO_PROBLEMS[2:], lambda count: PVPO_PROBLEMS[2:][:count])
    assert [p.uid for p in graded.problems] == ["2", "3", "2", "3"]
    assert metrics["dynamic_sampling_dropped_groups"] == 2.0 and metrics["dynamic_sampling_filled_groups"] == 0.0


def test_paper_intellect2_filters_offline_and_trains_on_stale_rollouts(tmp_path):
    cfg = typed_config(compose_config(["paper=intellect2"], tmp_path / "run"))
    assert cfg.trainer.difficulty_filter == DifficultyFilterConfig(samples=8, min_pass_rate=0.0, max_pass_rate=0.875)
    assert cfg.trainer.max_staleness == 2  # the delta cap acts on stale ratios


def test_a_difficulty_band_that_keeps_nothing_is_refused_before_the_model_loads(tmp_path):
    from rlbench.validation import validate_config

    cfg = compose_config(["experiment=smoke", "+trainer.difficulty_filter={min_pass_rate:0.9,max_pass_rate:0.1}"],
                         tmp_path / "run")
    with pytest.raises(ConfigError, match="min_pass_rate=0.9 is above max_pass_rate=0.1"):
        validate_config(cfg)


def test_the_trainers_sampler_writes_the_presets_target(make_cfg):
    from rlbench.config.typed import typed_config
    from rlbench.reward.graders import training_grader
    from rlbench.training.step import make_step_context

    cfg = make_cfg("experiment=smoke", "algorithm=intellect2")
    ctx = make_step_context(typed_config(cfg), algorithm_from(cfg.algorithm), torch.nn.Linear(2, 2), ChatCharTokenizer(),
                            None, torch.device("cpu"), training_grader(typed_config(cfg)))
    text = "".join(map(chr, ctx.sampler.encode(PVPO_PROBLEMS[:1])[0]))
    assert "q0\nThink for 3000 tokens before giving a response." in text  # uid 0's target, seed 0


def filter_rates(tmp_path, *overrides) -> list[float]:
    """The pass rates the offline difficulty filter records before step 1 (TrainingRun.presample) on the toy task
    (the tiny model, reward: the share of even token ids), 8 samples per problem."""
    from rlbench.model.loading import load_policy
    from rlbench.reward.graders import training_grader
    from rlbench.rollout.engines import make_engine
    from rlbench.training.loop import TrainingRun
    from rlbench.training.step import make_step_context

    cfg = compose_config(["experiment=toy_learning", "+trainer.difficulty_filter={samples:8}", *overrides], tmp_path / "run")
    config, cpu = typed_config(cfg), torch.device("cpu")
    model, tokenizer = load_policy(config.model, device=cpu, dtype=torch.float32, seed=cfg.seed, cache_dir=cfg.cache_dir)
    ctx = make_step_context(config, algorithm_from(cfg.algorithm), model, tokenizer,
                            make_engine(config.rollout, model, tokenizer, cpu), cpu, training_grader(config))
    problems = [Problem(str(i), f"{i} + 1 =", str(i + 1)) for i in range(6)]
    TrainingRun(config, ctx, problems, logger=None).presample()
    again = TrainingRun(config, ctx, problems, logger=None)  # as resumed: every rate is in the statistics
    again.filter_sampler = lambda model: pytest.fail("the filter built its sampler with nothing to sample")
    again.presample()
    return [ctx.prompt_stats.get(p.uid).reference_pass_rate for p in problems]


FILTER_MODEL = ["+model@trainer.difficulty_filter.model=tiny", "++trainer.difficulty_filter.model.tiny.vocab_size=512"]


def test_the_difficulty_filter_samples_the_model_it_is_given(tmp_path):
    """trainer.difficulty_filter.model (INTELLECT-2's distilled model, arXiv:2505.07291): a copy of the policy's node
    (the same weights) records the policy's own pass rates; a tiny model with other weights (a flat initial
    distribution) records others; with every rate already measured (a resumed run) no sampler is built."""
    policy = filter_rates(tmp_path / "a")
    same = filter_rates(tmp_path / "b", *FILTER_MODEL, "++trainer.difficulty_filter.model.tiny.initializer_range=1.0")
    other = filter_rates(tmp_path / "c", *FILTER_MODEL, "++trainer.difficulty_filter.model.tiny.initializer_range=0.02")
    assert same == policy
    assert other != policy


def test_a_missing_difficulty_filter_model_is_refused_before_the_model_loads(tmp_path):
    from rlbench.validation import validate_config

    cfg = compose_config(["experiment=smoke", "+trainer.difficulty_filter={samples:8}",
                          "+model@trainer.difficulty_filter.model=checkpoint",
                          f"trainer.difficulty_filter.model.path={tmp_path / 'absent'}"], tmp_path / "run")
    with pytest.raises(ConfigError, match="trainer.difficulty_filter.model: model.path=.*does not exist"):
        validate_config(cfg)
