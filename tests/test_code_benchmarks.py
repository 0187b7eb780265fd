"""Code benchmarks and custom benchmarks: loading, splits, field mapping, suites and validation."""

import json
import math

import pytest
import yaml

from rlbench.validation import validate_config
from rlbench.dataset import load_problems, validate_spec
from rlbench.errors import ConfigError, DataError
from rlbench.eval.metrics import ProblemResult, summarize

from conftest import ROOT, needs_data


def spec(group, name):
    return yaml.safe_load((ROOT / "conf" / group / f"{name}.yaml").read_text())


@pytest.mark.parametrize(
    "group, name, split, count, first, last",
    [
        ("benchmark", "mbpp", "test", 257, 11, 510),
        ("benchmark", "mbpp", "validation", 43, 511, 600),
        ("dataset", "mbpp", "train", 120, 601, 974),
    ],
)
@needs_data
def test_mbpp_splits_follow_the_task_id_ranges(group, name, split, count, first, last):
    problems = load_problems(spec(group, name), split)
    ids = [p.meta["id"] for p in problems]
    assert len(problems) == count
    assert min(ids) >= first and max(ids) <= last
    assert len(set(p.uid for p in problems)) == count


@needs_data
def test_mbpp_problem_carries_its_asserts_and_shows_the_first():
    problem = next(p for p in load_problems(spec("benchmark", "mbpp")) if p.meta["id"] == 17)
    tests = problem.meta["tests"]
    assert len(tests) >= 3 and all(t.startswith("assert") for t in tests)
    assert problem.prompt.endswith(tests[0])  # the example test names the function
    assert "def " in problem.answer  # reference solution kept
    assert problem.meta["entry_point"] is None and problem.meta["code_prefix"] == ""


@needs_data
def test_humaneval_problem_is_one_check_call_with_the_test_program_as_setup():
    problems = load_problems(spec("benchmark", "humaneval"))
    assert len(problems) == 164
    p = problems[0]
    assert p.uid == "humaneval/test/HumanEval/0"
    assert p.meta["tests"] == ["check(has_close_elements)"]
    assert "def check(candidate)" in p.meta["test_setup"]
    assert p.meta["code_prefix"] == p.prompt and p.prompt.startswith("from typing import List")


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def code_spec(path, **extra):
    return {
        "name": "mine", "answer_type": "code", "files": {"test": str(path)}, "split": "test",
        "fields": {"problem": "text", "tests": "asserts"}, "test_format": "assert_list", **extra,
    }


def test_custom_code_benchmark_from_any_jsonl(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"id": 5, "text": "Add two numbers.", "asserts": "assert add(1, 2) == 3\nassert add(0, 0) == 0"}])
    [problem] = load_problems(code_spec(path))
    assert problem.uid == "mine/test/5" and problem.meta["tests"] == ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]


def test_code_problem_uids_stay_unique_when_ids_repeat_or_are_missing(tmp_path):
    records = [{"id": 1, "text": "a", "asserts": ["assert True"]}, {"id": 1, "text": "b", "asserts": ["assert True"]},
               {"text": "c", "asserts": ["assert True"]}]
    problems = load_problems(code_spec(write_jsonl(tmp_path / "d.jsonl", records)))
    assert [p.uid for p in problems] == ["mine/test/0", "mine/test/1", "mine/test/2"]
    repeated = [{"id": 7, "text": "a", "asserts": ["assert True"]}, {"id": 7, "text": "b", "asserts": ["assert True"]}]
    problems = load_problems(code_spec(write_jsonl(tmp_path / "r.jsonl", repeated)))
    assert [p.uid for p in problems] == ["mine/test/0", "mine/test/1"]


@pytest.mark.parametrize(
    "record, message",
    [
        ({"id": 1, "text": "x"}, "no tests field"),
        ({"id": 1, "text": "x", "asserts": []}, "non-empty list of assert"),
        ({"id": 1, "asserts": ["assert True"]}, "no problem text"),
    ],
)
def test_malformed_code_records_name_the_file_and_line(tmp_path, record, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"id": 0, "text": "ok", "asserts": ["assert True"]}, record])
    with pytest.raises(DataError, match=message) as err:
        load_problems(code_spec(path))
    assert f"{path}:2" in str(err.value)


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"test_format": "pytest"}, "test_format"),
        ({"test_format": "check_function"}, "entry_point"),
        ({"id_range": {"train": [1, 2]}}, "id_range.test"),
        ({"answer_type": "image"}, "answer_type"),
        ({"fields": {"problem": "text"}}, "fields.tests"),
    ],
)
def test_bad_code_specs_are_refused_before_loading(tmp_path, extra, message):
    path = write_jsonl(tmp_path / "c.jsonl", [{"id": 0, "text": "ok", "asserts": ["assert True"]}])
    with pytest.raises(ConfigError, match=message):
        validate_spec(code_spec(path, **extra))


def test_custom_math_benchmark_maps_fields_from_the_command_line(make_cfg, tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [{"id": 1, "q": "2+3?", "a": 5}, {"id": 2, "q": "7*6?", "a": "42"}])
    cfg = make_cfg(
        "mode=eval", "eval=custom", f"eval.benchmarks.custom.files.test={path}",
        "eval.benchmarks.custom.fields.problem=q", "eval.benchmarks.custom.fields.answer=a",
    )
    validate_config(cfg)
    problems = load_problems(cfg.eval.benchmarks.custom)
    assert [(p.prompt, p.answer) for p in problems] == [("2+3?", "5"), ("7*6?", "42")]


def test_custom_code_benchmark_maps_fields_from_the_command_line(make_cfg, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"id": 9, "text": "Add.", "checks": ["assert add(1, 2) == 3"]}])
    cfg = make_cfg(
        "mode=eval", "eval=custom_code", f"eval.benchmarks.custom_code.files.test={path}",
        "eval.benchmarks.custom_code.fields.problem=text", "eval.benchmarks.custom_code.fields.tests=checks",
    )
    validate_config(cfg)
    [problem] = load_problems(cfg.eval.benchmarks.custom_code)
    assert problem.uid == "custom_code/test/9" and problem.meta["tests"] == ["assert add(1, 2) == 3"]
    assert problem.prompt.endswith("assert add(1, 2) == 3")


def test_custom_benchmark_without_a_file_names_the_key(make_cfg):
    with pytest.raises(ConfigError, match=r"eval\.benchmarks\.custom\.files\.test must be set"):
        validate_config(make_cfg("mode=eval", "eval=custom"))


@pytest.mark.parametrize(
    "dataset, suite, benchmarks",
    [
        ("arith", "arith", ["arith"]),
        ("gsm8k", "gsm8k", ["gsm8k"]),
        ("math", "math", ["gsm8k", "math500", "aime24", "amc23"]),
        ("mbpp", "code", ["humaneval", "mbpp"]),
    ],
)
def test_the_eval_suite_follows_the_training_set(make_cfg, dataset, suite, benchmarks):
    cfg = make_cfg(f"dataset={dataset}")
    assert cfg.eval.name == suite and list(cfg.eval.benchmarks) == benchmarks


def test_all_suite_holds_math_and_code(make_cfg):
    cfg = make_cfg("eval=all")
    assert list(cfg.eval.benchmarks) == ["gsm8k", "math500", "aime24", "amc23", "humaneval", "mbpp"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["dataset=mbpp"], "use reward=code"),
        (["dataset=gsm8k", "reward=code"], "reward=code runs tests"),
        (["dataset=mbpp", "reward=code", "sandbox.timeout_s=0"], "timeout_s must be a positive number"),
        (["dataset=mbpp", "reward=code", "sandbox.timeout_s=inf"], "above the ceiling"),
        (["dataset=mbpp", "reward=code", "sandbox.timeout_s=abc"], "timeout_s must be a positive number"),
        (["dataset=mbpp", "reward=code", "sandbox.file_size_mb=0.5"], "whole number"),
        (["dataset=mbpp", "reward=code", "sandbox.max_output_bytes=1000000000000"], "above the ceiling"),
        (["dataset=mbpp", "reward=code", "sandbox.workers=true"], "sandbox.workers"),
        (["dataset=mbpp", "reward=code", "reward.correct_reward=abc"], "reward.correct_reward must be a finite"),
    ],
)
@needs_data
def test_reward_and_dataset_must_agree(make_cfg, overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(make_cfg(*overrides))


def test_code_benchmarks_report_no_majority_vote():
    results = [
        ProblemResult("mbpp", "a", [True, False], [None, None], votable=False),
        ProblemResult("mbpp", "b", [False, False], [None, None], votable=False),
    ]
    [row] = summarize(results, [1])
    assert row["pass_at_k"] == pytest.approx(0.25) and math.isnan(row["maj_at_k"])
