"""Training-Free GRPO (arXiv:2510.08191): the experience library's update rules (pure functions: the fixed
rule and the model's add / modify / delete / keep operations, ids stable, invalid operations counted), the
contrast summariser with a scripted engine (zero-variance groups never reach the model; one extraction call
per group, then one update call per batch holding the library and every group's lessons), the library
in the prompts of the rollout and of the evaluation, state across steps, no optimizer step, the empty
library as rollout=iid exactly, and the preset from the command line."""

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
    LIBRARY_HEADER, OPERATION_FORMAT, Experience, ExperienceLibrary, ExperienceLibraryOptions, ExperienceLibraryRollout,
    LibraryOp, lesson_request, parse_lessons, parse_operations, render_library,
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
    """Rollouts: the i-th response of a group is "y" when i is even for a problem named "mixed ...", "n"
    otherwise (problem "flat": all "n", a zero-variance group). A summary prompt is answered "went <attempt>";
    an extraction prompt by two lessons naming the problem's last word, in list marks; an update prompt by
    the next scripted list of operations. Every prompt and budget is recorded."""

    def __init__(self, operations, lessons="- use {word}\n\n2) check {word}"):
        self.operations, self.lessons, self.prompts, self.budgets = list(operations), lessons, [], []

    def generate(self, requests, params, generator=None):
        out = []
        for r in requests:
            text = "".join(chr(t) for t in r.prompt_ids)
            self.prompts.append(text)
            self.budgets.append((params.max_new_tokens, params.temperature))
            if "New lessons from this batch" in text:
                answers = [self.operations.pop(0)]
            elif "Summaries of attempts" in text:
                word = text.split("\n")[0].split()[-1]
                answers = [self.lessons.format(word=word)]
            elif "An attempt: " in text:
                answers = ["went " + text.split("An attempt: ")[1][0]]
            else:
                answers = ["y" if "mixed" in text and i % 2 == 0 else "n" for i in range(r.n)]
            out.append([Completion(0, r.prompt_ids, [ord(a[0])], [-0.5], True, text=a) for a in answers])
        return out

    def calls(self, marker):
        return [p for p in self.prompts if marker in p]


def contrast_rollout(operations, max_items=8, **engine_options):
    engine = ScriptedEngine(operations, **engine_options)
    sampler = GroupSampler(engine, Grader(), CharTokenizer(), {"user": "{problem}"}, lambda r, _: r)
    setup = RolloutSetup(sampler, 4, SamplingParams(0.7, 1.0, 4), None)
    options = ExperienceLibraryOptions(max_items=max_items, summary_tokens=3, lesson_tokens=4, operation_tokens=5)
    return ExperienceLibraryRollout(setup, options), engine


def test_contrast_skips_zero_variance_groups_without_a_model_call():
    strategy, engine = contrast_rollout([])
    graded, metrics = strategy.rollout([Problem("1", "flat", "y"), Problem("2", "flat", "y")])
    assert engine.prompts == ["flat", "flat"] and metrics["groups_summarised"] == 0.0  # the rollouts only
    assert strategy.library == ExperienceLibrary() and metrics["library_invalid_ops"] == 0.0
    assert metrics["library_lessons"] == 0.0


def test_lessons_are_one_per_line_without_list_marks():
    assert parse_lessons("- a\n\n  2) b \n* c\n3. d e\n\u2022 f\n-\n", 3) == ["a", "b", "c", "d e", "f"]
    assert parse_lessons("a long lesson", 6) == ["a long"] and parse_lessons("  \n", 9) == []


BATCH = [Problem("1", "mixed a", "y"), Problem("2", "flat", "y"), Problem("3", "mixed b", "y"), Problem("4", "mixed c", "y")]
LESSONS = "Group 1:\n- use a\n- check a\nGroup 2:\n- use b\n- check b\nGroup 3:\n- use c\n- check c"


def test_a_batch_extracts_lessons_per_group_and_updates_the_library_in_one_call():
    strategy, engine = contrast_rollout([
        'add "use the letter"\nadd "check twice"\nadd "drop me"',
        'modify 0 "use the letter y"\ndelete 2\nkeep\nadd "z"\nmodify 9 "x"\ndelete 2\nadd ""\nthe lessons agree',
    ])
    graded, metrics = strategy.rollout(BATCH)
    # the three mixed groups: 12 summaries, 3 extractions (one per group, without the library), 1 update call
    assert len(engine.calls("An attempt: ")) == 12 and len(engine.calls("New lessons")) == 1
    extractions = [p for p in engine.calls("Summaries of attempts") if "New lessons" not in p]
    assert [p.split("\n")[0] for p in extractions] == ["Problem: mixed a", "Problem: mixed b", "Problem: mixed c"]
    assert "Attempt 1 (reward 1, success): went y\nAttempt 2 (reward 0, failure): went n" in extractions[0]
    assert all(LIBRARY_HEADER not in p for p in extractions)
    update = engine.prompts[-1]
    assert update.startswith(f"{LIBRARY_HEADER}\n(none yet)\n\nNew lessons from this batch of problems:\n{LESSONS}\n\n")
    assert update.endswith(OPERATION_FORMAT) and len(engine.prompts) == 4 + 12 + 3 + 1
    assert engine.budgets[4:] == [(3, 0.7)] * 12 + [(4, 0.7)] * 3 + [(5, 0.7)]
    assert strategy.library.items == (Experience(0, "use the letter", 0.5), Experience(1, "check twice", 0.5),
                                      Experience(2, "drop me", 0.5))
    assert (metrics["groups_summarised"], metrics["library_lessons"], metrics["library_added"]) == (3.0, 6.0, 3.0)
    # the next step: the library is in the policy's prompts and in the update prompt with its ids; add,
    # modify, delete and keep applied with stable ids; an unknown id, a deleted id, an empty text and a line
    # that is no operation are counted and skipped
    graded, metrics = strategy.rollout(BATCH)
    assert engine.prompts[20].startswith(f"{LIBRARY_HEADER}\n[0] use the letter\n[1] check twice\n[2] drop me\n\nProblem: mixed a")
    assert len(engine.calls("New lessons")) == 2
    assert engine.prompts[-1].startswith(f"{LIBRARY_HEADER}\n[0] use the letter\n[1] check twice\n[2] drop me\n\nNew lessons")
    assert strategy.library.items == (Experience(0, "use the letter y", 0.5), Experience(1, "check twice", 0.5),
                                      Experience(3, "z", 0.5))
    assert (metrics["library_added"], metrics["library_modified"], metrics["library_deleted"]) == (1.0, 1.0, 1.0)
    assert metrics["library_invalid_ops"] == 4.0 and strategy.library.next_id == 4


def test_a_batch_without_lessons_makes_no_update_call():
    strategy, engine = contrast_rollout([], lessons="  \n-")
    graded, metrics = strategy.rollout(BATCH)
    assert len(engine.calls("Summaries of attempts")) == 3 and metrics["groups_summarised"] == 3.0
    assert not engine.calls("New lessons") and metrics["library_lessons"] == 0.0 and strategy.library == ExperienceLibrary()


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
    # the default summariser is the paper's contrast: the tiny random model states lessons, but its batch
    # update answer holds no valid operation, and every line of it is counted and skipped (never an error)
    assert all("library_invalid_ops" in s for s in steps) and steps[0]["groups_summarised"] > 0
    assert steps[0]["library_lessons"] > 0
