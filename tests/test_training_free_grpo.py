"""Training-Free GRPO (arXiv:2510.08191): the experience library's update rules (pure functions: the fixed
rule and the model's add / modify / delete / keep operations, ids stable, invalid operations counted), the
contrast summariser with a scripted engine (zero-variance groups never reach the model, the library in the
extraction prompt), the library in the prompts of the rollout and of the evaluation, state across steps, no
optimizer step, the empty library as rollout=iid exactly, and the preset from the command line."""

from __future__ import annotations

import pytest
import torch

from conftest import CharTokenizer, smoke_cli_steps
from rlbench.config.typed import rollout_config
from conftest import algorithm_from
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.eval.evaluate import Benchmark
from rlbench.reward.math import Grade
from rlbench.rollout import GroupSampler, RolloutSetup, validate_strategy
from rlbench.rollout.engines.base import Completion, SamplingParams
from rlbench.rollout.guided.experience_library import (
    LIBRARY_HEADER, Experience, ExperienceLibrary, ExperienceLibraryOptions, ExperienceLibraryRollout, LibraryOp,
    lesson_request, parse_operations, render_library,
)
from rlbench.rollout.strategies.iid import IIDSampling
from rlbench.rollout.strategy import RolloutStrategy
from rlbench.runner import in_strategy_context
from rlbench.training.update_schedules import apply_update_schedule


def test_update_rule_adds_modifies_deletes_and_keeps_with_stable_ids():
    library, update = ExperienceLibrary().updated([("a", 0.5), ("b", 0.2), (" ", 9.0)], max_items=3)
    assert library.items == (Experience(0, "a", 0.5), Experience(1, "b", 0.2)) and library.next_id == 2
    assert update.added == (0, 1) and update.deleted == () and update.rejected == 0  # an empty lesson is dropped
    # same text modifies (the higher score wins); new text is added; over capacity the lowest score goes
    library, update = library.updated([("a ", 0.9), ("c", 0.3), ("d", 0.1)], max_items=3)
    assert [(i.id, i.text, i.score) for i in library.items] == [(0, "a", 0.9), (1, "b", 0.2), (2, "c", 0.3)]
    assert update.modified == (0,) and update.added == (2,) and update.rejected == 1  # "d" (0.1) never enters
    assert update.deleted == () and update.kept == (1,)
    # a lower score does not modify; on a tie the oldest is deleted; ids are never reused
    library, update = library.updated([("a", 0.1), ("e", 0.2)], max_items=3)
    assert [i.id for i in library.items] == [0, 2, 4] and library.next_id == 5
    assert update.modified == () and update.deleted == (1,) and update.added == (4,) and update.kept == (0, 2)
    # capacity 0: nothing is kept
    empty, update = library.updated([("f", 5.0)], max_items=0)
    assert empty.items == () and update.deleted == (0, 2, 4) and update.rejected == 1
    assert ExperienceLibrary.from_state(library.state_dict()) == library


def test_operations_are_parsed_strictly_and_unparseable_lines_counted():
    ops, unparsed = parse_operations('add "check the sign"\n\n  modify 3 "use x = 2"\nDELETE [4]\nkeep\n'
                                     'add check\nmodify x "t"\nI think we should add "a"\n')
    assert ops == [LibraryOp("add", None, "check the sign"), LibraryOp("modify", 3, "use x = 2"),
                   LibraryOp("delete", 4), LibraryOp("keep")]
    assert unparsed == 3  # an unquoted text, a non-numeric id, prose around an operation
    assert parse_operations("") == ([], 0)


def test_model_operations_keep_ids_stable_and_skip_invalid_ones():
    library, update = ExperienceLibrary().applied([LibraryOp("add", None, "a"), LibraryOp("add", None, " b ")], 0.5, 8)
    assert library.items == (Experience(0, "a", 0.5), Experience(1, "b", 0.5)) and update.added == (0, 1)
    library, update = library.applied(
        [LibraryOp("modify", 0, "a2"), LibraryOp("delete", 1), LibraryOp("add", None, "c"), LibraryOp("keep")], 0.25, 8)
    assert library.items == (Experience(0, "a2", 0.5), Experience(2, "c", 0.25)) and library.next_id == 3
    assert update.modified == (0,) and update.deleted == (1,) and update.added == (2,) and update.invalid == 0
    # a deleted id is never reused; unknown ids, a deleted id and empty texts are skipped and counted
    library, update = library.applied(
        [LibraryOp("delete", 1), LibraryOp("modify", 7, "x"), LibraryOp("add", None, "  "), LibraryOp("modify", 2, ""),
         LibraryOp("add", None, "d"), LibraryOp("modify", 2, "c2")], 0.75, 8, invalid=2)
    assert library.items == (Experience(0, "a2", 0.5), Experience(2, "c2", 0.75), Experience(3, "d", 0.75))
    assert update.invalid == 6 and update.added == (3,) and update.modified == (2,) and update.kept == (0,)
    # an item added and deleted in one update is rejected; past capacity the lowest-scored goes
    library, update = library.applied([LibraryOp("add", None, "e"), LibraryOp("delete", 4)], 0.1, 8)
    assert update.rejected == 1 and update.added == () and library.next_id == 5
    library, update = library.applied([LibraryOp("add", None, "f")], 0.6, 3)
    assert [i.id for i in library.items] == [2, 3, 5] and update.deleted == (0,)
    assert update.metrics()["library_invalid_ops"] == 0.0


class ScriptedEngine:
    """Rollouts: the i-th response of a group is "y" when i is even for problem "mixed", "n" otherwise
    (problem "flat": all "n", a zero-variance group). A summary prompt is answered "went <attempt>"; an
    extraction prompt by the next scripted list of operations. Every prompt and budget is recorded."""

    def __init__(self, operations):
        self.operations, self.prompts, self.budgets = list(operations), [], []

    def generate(self, requests, params, generator=None):
        out = []
        for r in requests:
            text = "".join(chr(t) for t in r.prompt_ids)
            self.prompts.append(text)
            self.budgets.append((params.max_new_tokens, params.temperature))
            if "Summaries of attempts" in text:
                answers = [self.operations.pop(0)]
            elif "An attempt: " in text:
                answers = ["went " + text.split("An attempt: ")[1][0]]
            else:
                answers = ["y" if "mixed" in text and i % 2 == 0 else "n" for i in range(r.n)]
            out.append([Completion(0, r.prompt_ids, [ord(a[0])], [-0.5], True, text=a) for a in answers])
        return out


def contrast_rollout(operations, max_items=8):
    engine = ScriptedEngine(operations)
    sampler = GroupSampler(engine, Grader(), CharTokenizer(), {"user": "{problem}"}, lambda r, _: r)
    setup = RolloutSetup(sampler, 4, SamplingParams(0.7, 1.0, 4), None)
    options = ExperienceLibraryOptions(max_items=max_items, summary_tokens=3, operation_tokens=5)
    return ExperienceLibraryRollout(setup, options), engine


def test_contrast_skips_zero_variance_groups_without_a_model_call():
    strategy, engine = contrast_rollout([])
    graded, metrics = strategy.rollout([Problem("1", "flat", "y"), Problem("2", "flat", "y")])
    assert engine.prompts == ["flat", "flat"] and metrics["groups_summarised"] == 0.0  # the rollouts only
    assert strategy.library == ExperienceLibrary() and metrics["library_invalid_ops"] == 0.0


def test_contrast_summarises_each_rollout_and_applies_the_models_operations():
    strategy, engine = contrast_rollout([
        'add "check parity"\nadd "answer y"',
        'modify 0 "check parity twice"\ndelete 1\nadd "z"',
        'delete 1\nmodify 7 "x"\nadd ""\nhello there\nkeep\nadd "w"',
    ])
    problems = [Problem("1", "mixed", "y"), Problem("2", "flat", "y")]
    graded, metrics = strategy.rollout(problems)
    # the mixed group only: 4 summaries (one per rollout, the run's sampling at summary_tokens), 1 extraction
    assert engine.prompts[2:6] == [f"Problem: mixed\n\nAn attempt: {a}\n\nIn one or two sentences, summarise the approach "
                                   "this attempt took and where it went right or wrong." for a in "ynyn"]
    assert engine.budgets[2:] == [(3, 0.7)] * 4 + [(5, 0.7)]
    extraction = engine.prompts[6]
    assert "Problem: mixed" in extraction and "flat" not in extraction and len(engine.prompts) == 7
    assert "Attempt 1 (reward 1, success): went y\nAttempt 2 (reward 0, failure): went n" in extraction
    assert f"{LIBRARY_HEADER}\n(none yet)" in extraction and 'modify <id> "<lesson>"' in extraction
    assert strategy.library.items == (Experience(0, "check parity", 0.5), Experience(1, "answer y", 0.5))
    assert metrics["groups_summarised"] == 1.0 and metrics["library_added"] == 2.0
    # the next step: the library is in the policy's prompts and in the extraction prompt, with its ids
    graded, metrics = strategy.rollout(problems)
    assert engine.prompts[7].startswith(f"{LIBRARY_HEADER}\n[0] check parity\n[1] answer y\n\nProblem: mixed")
    assert f"{LIBRARY_HEADER}\n[0] check parity\n[1] answer y\n\nCompare" in engine.prompts[-1]
    assert strategy.library.items == (Experience(0, "check parity twice", 0.5), Experience(2, "z", 0.5))
    assert (metrics["library_modified"], metrics["library_deleted"], metrics["library_added"]) == (1.0, 1.0, 1.0)
    # invalid operations are skipped and counted; the deleted id 1 is not reused
    graded, metrics = strategy.rollout(problems)
    assert [(i.id, i.text) for i in strategy.library.items] == [(0, "check parity twice"), (2, "z"), (3, "w")]
    assert metrics["library_invalid_ops"] == 4.0 and strategy.library.next_id == 4


def test_contrast_applies_the_groups_operations_in_batch_order_on_the_library_of_the_step_start():
    strategy, engine = contrast_rollout(['delete 0\nadd "r"', 'delete 0\nmodify 1 "q2"'])
    strategy.load_state_dict({"items": [[0, "p", 0.9], [1, "q", 0.1]], "next_id": 2})
    graded, metrics = strategy.rollout([Problem("1", "mixed a", "y"), Problem("2", "mixed b", "y")])
    extractions = [p for p in engine.prompts if "Summaries of attempts" in p]
    assert len(extractions) == 2 and all(f"{LIBRARY_HEADER}\n[0] p\n[1] q\n" in p for p in extractions)
    # the second group's delete 0 comes after the first group's: an id the library no longer holds
    assert [(i.id, i.text, i.score) for i in strategy.library.items] == [(1, "q2", 0.5), (2, "r", 0.5)]
    assert metrics["library_invalid_ops"] == 1.0 and metrics["groups_summarised"] == 2.0
    assert (metrics["library_added"], metrics["library_modified"], metrics["library_deleted"]) == (1.0, 1.0, 1.0)


def test_library_is_rendered_best_first():
    library = ExperienceLibrary((Experience(0, "low", 0.1), Experience(3, "high", 0.7)), 4)
    assert render_library(library) == f"{LIBRARY_HEADER}\n[3] high\n[0] low"


class CopyingEngine:
    """Answers "y" to a prompt that shows a "y" lesson; otherwise the i-th response of a group is "y" when
    i is even for problem "mixed", never for problem "flat" (a zero-variance group)."""

    def __init__(self):
        self.prompts = []

    def generate(self, requests, params, generator=None):
        out = []
        for r in requests:
            text = "".join(chr(t) for t in r.prompt_ids)
            self.prompts.append(text)
            answers = ["y" if "] y" in text or ("mixed" in text and i % 2 == 0) else "n" for i in range(r.n)]
            out.append([Completion(0, r.prompt_ids, [ord(a)], [-0.5], True, text=a) for a in answers])
        return out


class Grader:
    def __call__(self, text, answer, response_ids):
        return Grade(correct=text == "y", extracted=text, reward=float(text == "y"), format_ok=True)


def library_rollout(max_items=4, engine=None):
    sampler = GroupSampler(engine or CopyingEngine(), Grader(), CharTokenizer(), {"user": "Q: {problem}"}, lambda r, _: r)
    setup = RolloutSetup(sampler, 4, SamplingParams(1.0, 1.0, 4), None)
    return ExperienceLibraryRollout(setup, ExperienceLibraryOptions(max_items=max_items, summariser="best_response")), sampler


def test_lessons_come_from_contrasting_groups_and_change_the_next_prompts():
    strategy, sampler = library_rollout()
    problems = [Problem("1", "mixed", "y"), Problem("2", "flat", "y")]
    graded, metrics = strategy.rollout(problems)
    assert sampler.engine.prompts == ["Q: mixed", "Q: flat"]  # the first step: an empty library
    assert metrics["groups_summarised"] == 1.0  # the flat group (all 0) is skipped
    assert strategy.library.items == (Experience(0, "y", 0.5),)  # best response, r_best - mean = 1 - 0.5
    graded, metrics = strategy.rollout(problems)
    assert sampler.engine.prompts[2:] == [f"Q: {LIBRARY_HEADER}\n[0] y\n\nProblem: mixed", f"Q: {LIBRARY_HEADER}\n[0] y\n\nProblem: flat"]
    assert graded.rewards.tolist() == [1.0] * 8 and metrics["rollout_outcome_mean"] == 1.0
    assert graded.uids == ["1"] * 4 + ["2"] * 4
    assert metrics["groups_summarised"] == 0.0 and metrics["library_size"] == 1.0
    # the state carries the library to a new strategy (a resumed run)
    fresh, _ = library_rollout()
    fresh.load_state_dict(strategy.state_dict())
    assert fresh.library == strategy.library
    # the evaluation asks the same prompts
    bench = Benchmark("arith", {}, [Problem("t", "mixed", "y")], Grader())
    assert in_strategy_context([bench], fresh)[0].problems[0].prompt == f"{LIBRARY_HEADER}\n[0] y\n\nProblem: mixed"
    assert in_strategy_context([bench], RolloutStrategy(setup=None))[0].problems == bench.problems  # the base hook: unchanged


def test_an_empty_library_is_iid_exactly():
    problems = [Problem("1", "mixed", "y"), Problem("2", "flat", "y")]
    strategy, sampler = library_rollout(max_items=0)
    for _ in range(2):
        graded, metrics = strategy.rollout(problems)
    iid_engine = CopyingEngine()
    iid_sampler = GroupSampler(iid_engine, Grader(), CharTokenizer(), {"user": "Q: {problem}"}, lambda r, _: r)
    iid = IIDSampling(RolloutSetup(iid_sampler, 4, SamplingParams(1.0, 1.0, 4), None))
    for _ in range(2):
        expected, _ = iid.rollout(problems)
    assert sampler.engine.prompts == iid_engine.prompts
    assert torch.equal(graded.rewards, expected.rewards) and metrics["library_size"] == 0.0


def test_the_policy_summariser_asks_for_the_lesson():
    prompt = lesson_request(Problem("1", "2+2", "4"), Completion(0, (), [], [], True, text="4"),
                            Completion(0, (), [], [], True, text="5")).prompt
    assert prompt.startswith("Problem: 2+2\n\nA better answer: 4\n\nA worse answer: 5")
    engine = CopyingEngine()
    sampler = GroupSampler(engine, Grader(), CharTokenizer(), {"user": "{problem}"}, lambda r, _: r)
    setup = RolloutSetup(sampler, 4, SamplingParams(1.0, 1.0, 4), None)
    strategy = ExperienceLibraryRollout(setup, ExperienceLibraryOptions(summariser="policy", summary_tokens=2))
    assert ExperienceLibraryOptions().summariser == "contrast"  # the paper's is the default
    strategy.rollout([Problem("1", "mixed", "y")])
    assert engine.prompts[-1].startswith("Problem: mixed\n\nA better answer: y\n\nA worse answer: n")
    assert strategy.library.items[0].text == "y"  # the policy's answer to the lesson prompt ("mixed" in it: "y")


def test_settings_are_checked_before_the_model_loads():
    base = {"strategy": "experience_library", "n": 2}
    with pytest.raises(ConfigError, match="summariser"):
        validate_strategy(rollout_config({**base, "experience_library": {"summariser": "oracle"}}), "grpo")
    with pytest.raises(ConfigError, match="max_items"):
        validate_strategy(rollout_config({**base, "experience_library": {"max_items": -1}}), "grpo")
    with pytest.raises(ConfigError, match="operation_tokens"):
        validate_strategy(rollout_config({**base, "experience_library": {"operation_tokens": 0}}), "grpo")
    with pytest.raises(ConfigError, match="it takes"):
        validate_strategy(rollout_config({**base, "experience_library": {"library": 3}}), "grpo")


def test_schedule_none_never_steps_the_optimizer(make_cfg):
    cfg = make_cfg("algorithm=training_free_grpo")
    algorithm = algorithm_from(cfg.algorithm)
    assert algorithm.schedule == "none" and not algorithm.uses_optimizer
    model = torch.nn.Linear(2, 2)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    optimizer.step = lambda *a, **k: pytest.fail("the optimizer was stepped")
    assert apply_update_schedule(model, optimizer, None, algorithm, None) == {"optimizer_steps": 0.0}
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.slow
def test_training_free_grpo_runs_from_the_command_line(tmp_path):
    steps = smoke_cli_steps(tmp_path / "run", "algorithm=training_free_grpo", "trainer.steps=2")
    assert [s["optimizer_steps"] for s in steps] == [0.0, 0.0] and all("grad_norm" not in s for s in steps)
    assert all("library_size" in s for s in steps) and "outcome_mean" in steps[0]
    # the default summariser is the paper's contrast: the tiny random model writes no valid operation, and
    # every line it writes is counted and skipped (never an error)
    assert all("library_invalid_ops" in s for s in steps) and steps[0]["groups_summarised"] > 0
