"""CLPO's rewriting of problems by the policy (prompt_sampler=clpo, arXiv:2509.25004; rlbench/training/rewrites.py):
the buckets at their boundaries (the release's 0.3 / 0.7 and rlbench's earlier 0.2 / 0.8), the rewriter asked only for
the designated buckets, the rewrite prompt with and without the reference answer, the rewrite's temperature and
tokens, both answer checks (0 < c < k, the release's; c >= agreement k), the release's same-step mix (the step's
groups of 0 < acc < 1 plus the accepted rewrites' groups, each labelled) and the earlier next-steps pool (its share per
step, the cache of attempts, the checkpoint round trip), bad settings refused, and end-to-end runs whose evaluation
never sees a rewrite. A resumed run equals an uninterrupted one: tests/test_resume.py, STATEFUL_PRESETS['clpo']. The
dynamic KL that reads the labels: tests/test_dynamic_kl.py."""

import json
import re

import pytest
import torch
from conftest import compose_config

from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.reward import MathReward, grade_completions
from rlbench.reward.judge_tasks import AUX_TASK_KEY
from rlbench.rollout import GradedGroups
from rlbench.rollout.engines.base import Completion
from rlbench.training.curricula import ClpoOptions, ClpoPrompts, Curriculum, sampler_options
from rlbench.training.prompt_stats import PromptStatsStore
from rlbench.rollout.engines.base import SamplingParams
from rlbench.training.rewrites import (
    BUCKET_KEY,
    ORIGIN_KEY,
    STEP_KEY,
    TEMPLATES,
    PolicyRewriter,
    accepted,
    difficulty_bucket,
    is_rewrite,
    response_labels,
    rewrite_request,
    rewritten_problem,
)
from rlbench.validation import validate_config

GRADER = MathReward()


def completion(text: str) -> Completion:
    return Completion(request_index=0, prompt_ids=[1], text=text, response_ids=[1, 2], logprobs=[0.0, 0.0], finished=True)


def sums(count: int, start: int = 0) -> list[Problem]:
    """'What is a + b?' problems whose answer is a + b."""
    return [Problem(uid=f"d/{i}", prompt=f"What is {i} + {i + 1}?", answer=str(2 * i + 1)) for i in range(start, start + count)]


def true_answer(statement: str) -> str:
    """The answer a problem's statement asks for: the sum of the numbers in it (how the mock policy solves)."""
    return str(sum(int(x) for x in re.findall(r"-?\d+", statement)))


def answered(problems: list[Problem], answers: list[list[str]]) -> GradedGroups:
    """Group g: the responses \\boxed{a} for a in answers[g], graded by the math grader against problem g."""
    groups = [[completion(f"\\boxed{{{a}}}") for a in group] for group in answers]
    flat = [p for p, g in zip(problems, groups) for _ in g]
    grades = grade_completions(GRADER, flat, [c for g in groups for c in g])
    b = len(flat)
    return GradedGroups(list(problems), groups, grades, torch.zeros(b), torch.zeros(b), torch.ones(b, dtype=torch.bool),
                        list(range(len(groups))))


def graded(problems: list[Problem], right: list[int], size: int = 4) -> GradedGroups:
    """Groups of ``size`` responses, ``right[g]`` of them correct for problem g (graded by the math grader)."""
    return answered(problems, [[p.answer if k < r else "no" for k in range(size)] for p, r in zip(problems, right)])


# rlbench's earlier rule (before the release's values were read): next-steps pool, >= half correct, 0.2 / 0.8
EARLIER = dict(hard_below=0.2, easy_above=0.8, easy_strict=False, easy_weight=0.25, mixing="next_steps", share=0.25,
               acceptance="agreement", rewrite_tokens=128, rewrite_temperature=None, show_answer=False, retry_after=0)


class MockPolicy:
    """A rewriter that answers each request with ``edit(statement, bucket)`` and solves a rewrite by the sum of the
    numbers it states (its first ``right(rewrite)`` answers of ``samples``, the rest wrong: all by default); its
    answers are graded by the run's grader against the rewrite's (the origin's) reference."""

    def __init__(self, edit=lambda statement, bucket: statement.replace("What is", "Compute"), samples: int = 4,
                 right=None):
        self.edit, self.samples, self.right = edit, samples, right or (lambda problem: samples)
        self.requests: list[Problem] = []

    def rewrite(self, requests, generator):
        torch.rand(len(requests), generator=generator)  # the policy samples from the rewriting stream
        self.requests += requests
        out = []
        for request in requests:
            bucket = next(b for b, text in TEMPLATES.items() if request.prompt.startswith(text))
            out.append(self.edit(request.prompt.split("\n\nProblem: ", 1)[1], bucket))
        return out

    def solve(self, problems, generator):
        return answered(problems, [[true_answer(p.prompt) if k < self.right(p) else "no" for k in range(self.samples)]
                                   for p in problems])


def clpo(problems: list[Problem], seed: int = 0, **options) -> ClpoPrompts:
    """The sampler with rlbench's earlier rule and ``options`` over it, and the mock policy."""
    return release(problems, seed, **{**EARLIER, **options})


def release(problems: list[Problem], seed: int = 0, **options) -> ClpoPrompts:
    """The sampler with the release's values (the defaults) and ``options`` over them, and the mock policy."""
    sampler = ClpoPrompts(problems, seed, PromptStatsStore(), ClpoOptions(**options))
    sampler.rewriter = MockPolicy()
    return sampler


# earlier: p = 0.2 is hard, 0.8 easy (both inclusive); 0.25 and 0.75 (1 and 3 of 4 correct) are medium
@pytest.mark.parametrize("p, bucket", [(0.0, "hard"), (0.2, "hard"), (0.2000001, "medium"), (0.25, "medium"),
                                        (0.75, "medium"), (0.7999999, "medium"), (0.8, "easy"), (1.0, "easy")])
def test_buckets_at_their_boundaries_and_their_draw_weights(p, bucket):
    assert difficulty_bucket(p, 0.2, 0.8) == bucket
    weight = {"hard": 1.0, "medium": 1.0, "easy": 0.25}[bucket]
    assert ClpoOptions(**EARLIER).weight(p) == weight


# the release (ray_trainer.py: hard acc <= 0.3, medium 0.3 < acc <= 0.7, else easy): 1 of 4 correct is hard, 3 of 4
# easy; no bucket is down-weighted
@pytest.mark.parametrize("p, bucket", [(0.0, "hard"), (0.25, "hard"), (0.3, "hard"), (0.3000001, "medium"), (0.5, "medium"),
                                        (0.7, "medium"), (0.7000001, "easy"), (0.75, "easy"), (1.0, "easy")])
def test_the_release_buckets_at_their_boundaries(p, bucket):
    assert difficulty_bucket(p, 0.3, 0.7, easy_strict=True) == bucket == ClpoOptions().bucket(p)
    assert ClpoOptions().weight(p) == 1.0


def test_the_rewriter_is_asked_only_for_the_designated_buckets():
    problems = sums(5)
    aux = Problem(uid="aux/0", prompt="Revise: 1 + 2 = 4", answer="3", meta={AUX_TASK_KEY: "reflection"})
    old = rewritten_problem(problems[0], "Compute 0 + 1.", "hard", 1)
    sampler = clpo(problems)
    # 0, 1, 2, 3, 4 of 4 correct: hard (0.0), medium (0.25), medium (0.5), medium (0.75), easy (1.0); the auxiliary
    # task and the earlier rewrite (both unsolved) are never rewritten
    sampler.observe(2, graded([*problems, aux, old], [0, 1, 2, 3, 4, 0, 0]))
    asked = [(r.uid, next(b for b, t in TEMPLATES.items() if r.prompt.startswith(t))) for r in sampler.rewriter.requests]
    assert asked == [("d/0", "hard"), ("d/1", "medium"), ("d/2", "medium"), ("d/3", "medium")]
    assert sampler.metrics()["clpo_rewrites_attempted"] == 4
    assert sampler.metrics()["clpo_rewritten_share"] == pytest.approx(1 / 7)  # the earlier rewrite's group

    only_hard = clpo(problems, rewrite=("hard",))
    only_hard.observe(2, graded(problems, [0, 1, 2, 3, 4]))
    assert [r.uid for r in only_hard.rewriter.requests] == ["d/0"]


def test_a_rewrite_whose_answer_changed_is_rejected_and_counted():
    problems = sums(3)  # 0 + 1, 1 + 2, 2 + 3: answers 1, 3, 5
    # the rewrite of d/1 changes a number (answer 4, not 3); d/0 and d/2 keep their numbers
    def edit(statement, bucket):
        return statement.replace("1 + 2", "1 + 3") if "1 + 2" in statement else f"Please add: {statement}"

    sampler = clpo(problems)
    sampler.rewriter = MockPolicy(edit)
    sampler.observe(1, graded(problems, [0, 0, 2]))  # hard, hard, medium
    pool = list(sampler.pool.items)
    assert [p.uid for p in pool] == ["d/0~clpo-hard-1", "d/2~clpo-medium-1"]
    assert all(p.answer == o.answer for p, o in zip(pool, [problems[0], problems[2]]))
    assert [(p.meta[ORIGIN_KEY], p.meta[BUCKET_KEY], p.meta[STEP_KEY]) for p in pool] == [("d/0", "hard", 1), ("d/2", "medium", 1)]
    metrics = sampler.metrics()
    assert (metrics["clpo_rewrites_attempted"], metrics["clpo_rewrites_accepted"], metrics["clpo_rewrites_rejected"]) == (3, 2, 1)
    assert metrics["clpo_rewrites_rejected_total"] == 1 and metrics["clpo_rewrite_pool"] == 2


@pytest.mark.parametrize("correct, agreement, kept", [
    ([True, True, False, False], 0.5, True),  # 2 of 4 >= 0.5 * 4
    ([True, False, False, False], 0.5, False),
    ([True, True, True, False], 1.0, False),
    ([False] * 4, 0.0, True),  # agreement 0: every well-formed rewrite
    ([], 0.0, False),  # never checked
])
def test_the_answer_check(correct, agreement, kept):
    origin = sums(1)[0]
    assert accepted(origin, rewritten_problem(origin, "Compute 0 + 1.", "hard", 1), correct, agreement) == kept


# the release's keep_mid_acc: kept iff 0 < c < k, whatever agreement says
@pytest.mark.parametrize("correct, kept", [([True, False, False, False], True), ([True, True, True, False], True),
                                           ([True] * 4, False), ([False] * 4, False), ([], False)])
def test_the_release_answer_check_keeps_a_rewrite_with_a_learning_signal(correct, kept):
    origin = sums(1)[0]
    rewrite = rewritten_problem(origin, "Compute 0 + 1.", "hard", 1)
    assert accepted(origin, rewrite, correct, 0.5, "mixed") == accepted(origin, rewrite, correct, 0.0, "mixed") == kept
    assert not accepted(origin, rewritten_problem(origin, "What is 0 + 1?", "hard", 1), [True, False], 0.5, "mixed")


def test_the_rewrite_prompt_states_the_reference_answer_only_when_asked():
    origin = Problem(uid="d/7", prompt="What is 7 + 8?", answer="15")
    shown, hidden = rewrite_request(origin, "hard", show_answer=True), rewrite_request(origin, "hard")
    assert shown.prompt.startswith(TEMPLATES["hard"]) and hidden.prompt.startswith(TEMPLATES["hard"])
    assert "same correct answer as the original: 15." in shown.prompt and "Do not reveal" in shown.prompt
    assert "15" not in hidden.prompt.replace("7 + 8", "")
    assert shown.prompt.endswith("\n\nProblem: What is 7 + 8?") and hidden.prompt.endswith("\n\nProblem: What is 7 + 8?")
    sampler = release(sums(1))  # the release's default: the answer shown
    sampler.observe(1, graded(sums(1), [1]))
    assert "same correct answer as the original: 1." in sampler.rewriter.requests[0].prompt


class RecordingSampler:
    """A GroupSampler stand-in that records each call's sampling and count."""

    def __init__(self):
        self.calls = []

    def sample(self, problems, n, params, generator):
        self.calls.append(("rewrite", n, params))
        return [[completion("Compute 1 + 2.")] for _ in problems]

    def __call__(self, problems, n, params, generator):
        self.calls.append(("solve", n, params))
        return graded(list(problems), [1] * len(problems), size=n)


@pytest.mark.parametrize("temperature, expected", [(0.7, 0.7), (None, 1.3)])
def test_the_rewrite_is_sampled_at_its_own_temperature_and_budget_and_answered_n_times(temperature, expected):
    from types import SimpleNamespace

    ctx = SimpleNamespace(params=SamplingParams(1.3, 0.9, 64), sampler=RecordingSampler(),
                          strategy=SimpleNamespace(setup=SimpleNamespace(n=3)))
    rewriter = PolicyRewriter(ctx, 400, None, temperature)
    assert rewriter.rewrite(sums(2), torch.Generator()) == ["Compute 1 + 2."] * 2
    solved = rewriter.solve(sums(2), torch.Generator())
    assert [len(g) for g in solved.groups] == [3, 3]  # verify_samples null: rollout.n
    assert ctx.sampler.calls == [("rewrite", 1, SamplingParams(expected, 0.9, 400)), ("solve", 3, ctx.params)]
    PolicyRewriter(ctx, 400, 5, temperature).solve(sums(1), torch.Generator())
    assert ctx.sampler.calls[-1][1] == 5


def test_the_release_mixes_the_accepted_rewrites_into_the_same_step():
    """0..4 of 4 correct: d/0 (0.0) and d/1 (0.25) hard, d/2 (0.5) medium, d/3 (0.75) and d/4 (1.0) easy. The mock
    answers d/0's rewrite 4 of 4 right (rejected: no signal), d/1's 2 and d/2's 1 (kept). The step trains on d/1, d/2,
    d/3 (0 < acc < 1; d/0 and d/4 leave the loss) and the two kept rewrites' groups, each labelled; no pool."""
    problems = sums(5)
    sampler = release(problems)
    sampler.rewriter = MockPolicy(right=lambda p: {"d/0": 4, "d/1": 2, "d/2": 1}[p.meta[ORIGIN_KEY]])
    step = graded(problems, [0, 1, 2, 3, 4])
    trained = sampler.observe(3, step)
    assert [p.uid for p in trained.problems] == ["d/1", "d/2", "d/3", "d/1~clpo-hard-3", "d/2~clpo-medium-3"]
    assert [p.meta[BUCKET_KEY] for p in trained.problems] == ["hard", "medium", "easy", "hard", "medium"]
    assert trained.group_ids == [1, 2, 3, 5, 6]  # the step's own ids, then new ones after them
    assert [sum(g.correct for g in trained.grades[4 * k:4 * k + 4]) for k in range(5)] == [1, 2, 3, 2, 1]
    assert response_labels(trained) == ["hard"] * 4 + ["medium"] * 4 + ["easy"] * 4 + ["hard"] * 4 + ["medium"] * 4
    assert all(BUCKET_KEY not in p.meta for p in problems)  # the dataset's problems are not changed
    assert not sampler.pool.items and sampler.next(4) and not any(map(is_rewrite, sampler.next(8)))
    metrics = sampler.metrics()
    assert (metrics["clpo_rewrites_attempted"], metrics["clpo_rewrites_accepted"], metrics["clpo_rewrites_rejected"]) == (3, 2, 1)
    assert metrics["clpo_trained_groups"] == 5 and metrics["clpo_rewritten_share"] == 2 / 5


def test_a_same_step_mix_left_with_nothing_trains_on_the_whole_step():
    problems = sums(2)
    sampler = release(problems)
    sampler.rewriter = MockPolicy(right=lambda p: 0)  # the hard rewrite of d/0 is never solved: rejected
    step = graded(problems, [0, 4])
    trained = sampler.observe(1, step)
    assert [p.uid for p in trained.problems] == ["d/0", "d/1"] and trained.group_ids == step.group_ids
    assert response_labels(trained) == ["hard"] * 4 + ["easy"] * 4


def test_the_next_steps_mix_labels_the_step_and_trains_on_all_of_it():
    problems = sums(3)
    sampler = clpo(problems)
    trained = sampler.observe(1, graded(problems, [0, 2, 4]))
    assert [p.uid for p in trained.problems] == ["d/0", "d/1", "d/2"]
    assert [p.meta[BUCKET_KEY] for p in trained.problems] == ["hard", "medium", "easy"]
    assert len(sampler.pool.items) == 2  # d/0 hard and d/1 medium, for later steps


@pytest.mark.parametrize("text", ["", "   ", "What is 0 + 1?", "New problem: What is 0 + 1?"])
def test_an_empty_or_unchanged_rewrite_is_rejected_without_being_solved(text):
    sampler = clpo(sums(1), agreement=0.0)
    sampler.rewriter = MockPolicy(lambda statement, bucket: text)
    sampler.rewriter.solve = lambda problems, generator: pytest.fail("an unchanged rewrite was solved")
    sampler.observe(1, graded(sums(1), [0]))
    assert not sampler.pool.items and sampler.metrics()["clpo_rewrites_rejected"] == 1


def pool_of(sampler: ClpoPrompts, count: int) -> None:
    """Fill the sampler's pool with ``count`` accepted rewrites (problems d/100.. rewritten at step 1)."""
    sampler.observe(1, graded(sums(count, start=100), [0] * count))
    assert len(sampler.pool.items) == count


# round(share * B), at least 1 when share > 0, at most B - 1; a pool smaller than that gives what it has
@pytest.mark.parametrize("share, batch, pool, expected", [(0.25, 8, 10, 2), (0.5, 8, 10, 4), (0.1, 4, 10, 1),
                                                          (0.5, 8, 3, 3), (0.0, 8, 10, 0), (0.25, 8, 0, 0)])
def test_the_share_of_rewrites_holds_per_step(share, batch, pool, expected):
    sampler = clpo(sums(20), share=share)
    pool_of(sampler, pool) if pool else None
    for _ in range(3):
        prompts = sampler.next(batch)
        rewrites = [p for p in prompts if is_rewrite(p)]
        assert len(prompts) == batch and len(rewrites) == expected and len({p.uid for p in rewrites}) == expected
        assert all(not is_rewrite(p) for p in prompts[: batch - expected])  # the dataset's problems first


def overrides(options: dict) -> list[str]:
    """``options`` as command-line overrides of trainer.prompt_sampler.clpo."""
    def value(v):
        return "null" if v is None else str(v).lower() if isinstance(v, bool) else v

    return [f"trainer.prompt_sampler.clpo.{key}={value(v)}" for key, v in options.items()]


def test_the_curriculum_mixes_the_rewrites_and_reports_the_counts(tmp_path):
    from rlbench.config.typed import typed_config

    trainer = typed_config(compose_config(["experiment=smoke", "prompt_sampler=clpo", "trainer.prompts_per_step=4",
                                           *overrides(EARLIER)], tmp_path)).trainer
    curriculum = Curriculum(trainer, seed=0, problems=sums(8))
    curriculum.sampler.rewriter = MockPolicy()
    first = curriculum.prompts(1, ctx=None)
    assert not [p for p in first if is_rewrite(p)]
    curriculum.observe(1, graded(first, [0] * 4))  # all hard: four rewrites, all kept
    assert curriculum.metrics()["clpo_rewrites_accepted"] == 4
    second = curriculum.prompts(2, ctx=None)
    assert sum(map(is_rewrite, second)) == 1  # round(0.25 * 4)
    curriculum.observe(2, graded(second, [0] * 4))
    assert curriculum.metrics()["clpo_rewritten_share"] == 0.25


def test_a_problem_is_rewritten_once_per_bucket_unless_configured():
    problems = sums(2)
    once = clpo(problems)
    for step in (1, 2, 3):
        once.observe(step, graded(problems, [0, 0]))
    assert [r.uid for r in once.rewriter.requests] == ["d/0", "d/1"]
    once.observe(4, graded(problems, [2, 0]))  # d/0 is medium now: a new (uid, bucket)
    assert [r.uid for r in once.rewriter.requests] == ["d/0", "d/1", "d/0"]

    again = clpo(problems[:1], retry_after=2)
    for step in (1, 2, 3, 4, 5):
        again.observe(step, graded(problems[:1], [0]))
    assert [p.uid for p in again.pool.items] == ["d/0~clpo-hard-1", "d/0~clpo-hard-3", "d/0~clpo-hard-5"]


def test_the_rewrite_pool_round_trips_through_a_checkpoint():
    problems = sums(20)
    sampler = clpo(problems, share=0.5)
    pool_of(sampler, 6)
    sampler.next(8)
    state = json.loads(json.dumps(sampler.state_dict(), default=lambda t: t.tolist()))  # what a checkpoint keeps
    state["rewrites"]["generator"] = torch.tensor(state["rewrites"]["generator"], dtype=torch.uint8)
    resumed = clpo(problems, share=0.5)
    resumed.load_state_dict(state)
    assert list(resumed.pool.items) == list(sampler.pool.items) and resumed.pool.attempted == sampler.pool.attempted
    def run_wide(metrics):
        return {k: v for k, v in metrics.items() if k.endswith("_total") or k == "clpo_rewrite_pool"}

    assert run_wide(resumed.metrics()) == run_wide(sampler.metrics()) and sampler.metrics()["clpo_rewrites_drawn_total"] == 4
    for _ in range(3):  # the same draws and the same rewriting stream
        assert [p.uid for p in resumed.next(8)] == [p.uid for p in sampler.next(8)]
    assert torch.equal(resumed.pool.generator.get_state(), sampler.pool.generator.get_state())
    assert torch.rand(1, generator=resumed.pool.generator).item() == torch.rand(1, generator=sampler.pool.generator).item()


@pytest.mark.parametrize("setting, message", [
    ("trainer.prompt_sampler.clpo.rewrite=[easy]", "rewrite"), ("trainer.prompt_sampler.clpo.share=1.0", "share"),
    ("trainer.prompt_sampler.clpo.agreement=1.5", "agreement"), ("trainer.prompt_sampler.clpo.verify_samples=0", "verify_samples"),
    ("+trainer.prompt_sampler.clpo.shares=0.5", "did you mean"), ("trainer.max_staleness=1", "max_staleness=null"),
    ("trainer.prompt_sampler.clpo.share=0.25", "mixing=same_step"), ("trainer.prompt_sampler.clpo.mixing=later", "mixing"),
    ("trainer.prompt_sampler.clpo.acceptance=half", "acceptance"), ("trainer.prompt_sampler.clpo.verify_samples=3", "rollout.n"),
    ("trainer.prompt_sampler.clpo.rewrite_temperature=-1", "rewrite_temperature"),
])
def test_bad_settings_are_refused_before_the_model_loads(setting, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        validate_config(compose_config(["experiment=smoke", "prompt_sampler=clpo", setting], tmp_path))


def test_the_preset_composes_the_paper_buckets(tmp_path):
    from rlbench.config.typed import typed_config

    cls, options = sampler_options(typed_config(compose_config(["experiment=smoke", "prompt_sampler=clpo"], tmp_path)).trainer.prompt_sampler)
    assert cls is ClpoPrompts and options == ClpoOptions()  # the YAML states the dataclass's defaults: the release's
    assert (options.hard_below, options.easy_above, options.easy_strict, options.mixing, options.acceptance) == (
        0.3, 0.7, True, "same_step", "mixed")
    assert (options.rewrite_tokens, options.rewrite_temperature, options.show_answer, options.share) == (400, 0.7, True, 0.0)


def test_a_run_trains_on_rewrites_and_its_evaluation_never_sees_one(tmp_path, monkeypatch):
    """`rlbench prompt_sampler=clpo experiment=smoke`, every well-formed rewrite kept (agreement 0): steps 2-3 train on
    rewrites, and every problem the evaluations are given is a benchmark problem."""
    import rlbench.runner as runner

    seen = []
    evaluate = runner.evaluate
    monkeypatch.setattr(runner, "evaluate", lambda engine, tok, benchmarks, **kw: (
        seen.extend(p for b in benchmarks for p in b.problems), evaluate(engine, tok, benchmarks, **kw))[1])
    settings = ["experiment=smoke", "prompt_sampler=clpo", *overrides({**EARLIER, "agreement": 0, "share": 0.5}),
                "trainer.steps=3", "eval.every=2", "logger=files", "trainer.save_model=false"]
    runner.run(compose_config(settings, tmp_path))
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s["clpo_rewritten_share"] for s in steps] == [0.0, 0.5, 0.5]
    assert steps[0]["clpo_rewrites_accepted"] > 0
    assert seen and all(p.uid.startswith("arith/test/") and not is_rewrite(p) for p in seen)
    assert "~clpo" not in (tmp_path / "eval" / "samples.jsonl").read_text()


def test_a_release_run_trains_on_its_rewrites_in_the_same_step(tmp_path):
    """`rlbench prompt_sampler=clpo experiment=smoke` with every well-formed rewrite kept (acceptance=agreement,
    agreement 0) and the dynamic KL on: each step trains on its own rewrites (the tiny policy solves nothing, so its
    problems are all hard and leave the loss, and the step falls back to none of them)."""
    import rlbench.runner as runner

    settings = ["experiment=smoke", "prompt_sampler=clpo", *overrides({"acceptance": "agreement", "agreement": 0,
                                                                       "rewrite_tokens": 16}),
                "algorithm.kl.coef=0.001", "+algorithm.kl.difficulty_scale.hard=0.5",
                "trainer.steps=2", "logger=files", "trainer.save_model=false"]
    runner.run(compose_config(settings, tmp_path))
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for s in steps:
        assert s["clpo_rewrites_accepted"] > 0 and s["clpo_rewritten_share"] > 0
        assert s["clpo_trained_groups"] >= s["clpo_rewrites_accepted"]
