"""Tests for rlbench.dataset: arith generator, JSONL loading, answer extraction, prompts, config checks."""

from __future__ import annotations

import ast
import json
import operator
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlbench.dataset import (
    Problem,
    build_messages,
    extract_answer,
    extract_last_boxed,
    generate_arith,
    load_problems,
    resolve_data_dir,
    validate_spec,
)
from rlbench.errors import ConfigError, DataError

REPO = Path(__file__).resolve().parent.parent
CONF = REPO / "conf"
DATA = REPO.parent / "shared" / "data"

needs_data = pytest.mark.skipif(not DATA.is_dir(), reason="shared data directory not present")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    """Tests decide about RLBENCH_DATA_DIR and Hub offline flags themselves."""
    monkeypatch.delenv("RLBENCH_DATA_DIR", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)


def load_conf(group: str, name: str, **overrides):
    """Load one YAML from conf/ as a DictConfig, with top-level overrides merged in."""
    cfg = OmegaConf.load(CONF / group / f"{name}.yaml")
    if overrides:
        cfg = OmegaConf.merge(cfg, overrides)
    return cfg


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def safe_eval(expression: str) -> int:
    """Evaluate an integer + - * expression via the AST (no eval of arbitrary code)."""

    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        raise ValueError(f"unexpected node {ast.dump(node)}")

    return walk(ast.parse(expression, mode="eval"))


def write_jsonl(path: Path, lines: list[str]) -> Path:
    """Write ``lines`` as a JSONL file (creating folders) and return its path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def tmp_spec(files: dict, **extra) -> dict:
    """A minimal jsonl spec named "toy" over ``files``, with top-level keys overridden by ``extra``."""
    spec = {
        "name": "toy",
        "loader": "jsonl",
        "hub_id": "someone/toy",
        "files": files,
        "split": "test",
        "fields": {"problem": "question", "answer": "answer"},
        "answer_format": "raw",
        "limit": None,
        "prompt": {"system": None, "user": "{problem}"},
    }
    spec.update(extra)
    return spec


# ----------------------------------------------------------------------------- arith


@pytest.mark.parametrize("level", [1, 2, 3, 4, 5])
def test_arith_answers_are_correct(level):
    problems = generate_arith(level, 200, seed=3, split="train")
    assert len(problems) == 200
    for p in problems:
        assert p.answer == str(safe_eval(p.prompt)), p.prompt
        assert p.meta == {"level": level}
    if level == 2:
        assert any(int(p.answer) < 0 for p in problems)
    if level == 4:
        assert any("*" in p.prompt and ("+" in p.prompt or "-" in p.prompt) for p in problems)


def test_arith_level_shapes():
    assert all(len(p.prompt.split()) == 3 for p in generate_arith(1, 30, 0, "train"))
    for p in generate_arith(3, 50, 0, "train"):
        a, op, b = p.prompt.split()
        assert op == "*" and 10 <= int(a) <= 99 and 2 <= int(b) <= 9
    for p in generate_arith(5, 50, 0, "train"):
        tokens = p.prompt.split()
        assert len(tokens) == 5 and tokens.count("*") <= 1
        assert all(10 <= int(t) <= 999 for t in tokens[::2])


def test_arith_deterministic_and_seed_dependent():
    a = generate_arith(2, 300, seed=7, split="train")
    b = generate_arith(2, 300, seed=7, split="train")
    c = generate_arith(2, 300, seed=8, split="train")
    assert a == b
    assert [p.prompt for p in a] != [p.prompt for p in c]
    assert generate_arith(2, 50, seed=7, split="test") == generate_arith(2, 50, seed=7, split="test")


@pytest.mark.parametrize("level", [1, 2, 3, 4, 5])
def test_arith_train_test_disjoint(level):
    train = {p.prompt for p in generate_arith(level, 2000, seed=0, split="train")}
    for seed in (0, 1):
        test = {p.prompt for p in generate_arith(level, 100, seed=seed, split="test")}
        assert not train & test


def test_arith_unique_within_split_when_space_allows():
    problems = generate_arith(2, 500, seed=0, split="train")
    assert len({p.prompt for p in problems}) == 500
    # Level 1 has only 100 expressions; a big request still returns the requested size.
    assert len(generate_arith(1, 300, seed=0, split="train")) == 300


def test_arith_does_not_touch_global_rng():
    import random

    random.seed(123)
    expected = random.random()
    random.seed(123)
    generate_arith(4, 100, seed=0, split="train")
    assert random.random() == expected


def test_arith_rejects_bad_arguments():
    with pytest.raises(ConfigError, match="level"):
        generate_arith(9, 10, 0, "train")
    with pytest.raises(ConfigError, match="split"):
        generate_arith(1, 10, 0, "validation")
    with pytest.raises(ConfigError, match="size"):
        generate_arith(1, -1, 0, "train")


def test_arith_mixed_levels_cycle_and_reduce_to_one_level():
    from rlbench.dataset.arith import generate_arith_levels

    mixed = generate_arith_levels([1, 2], 9, 3, "train")
    assert [p.meta["level"] for p in mixed] == [1, 2, 1, 2, 1, 2, 1, 2, 1]
    assert [p.uid for p in mixed] == [f"arith/train/{i}" for i in range(9)]
    # Each level contributes the first problems of its own list, in order.
    assert [p.prompt for p in mixed[0::2]] == [p.prompt for p in generate_arith(1, 5, 3, "train")]
    assert [p.prompt for p in mixed[1::2]] == [p.prompt for p in generate_arith(2, 4, 3, "train")]
    assert generate_arith_levels([2], 7, 3, "test") == generate_arith(2, 7, 3, "test")
    assert generate_arith_levels(2, 7, 3, "test") == generate_arith(2, 7, 3, "test")
    assert generate_arith_levels([1, 2], 0, 3, "train") == []
    for bad in ([], [1, 1], [1, 9]):
        with pytest.raises(ConfigError, match="level"):
            generate_arith_levels(bad, 4, 0, "train")


def test_arith_mixed_levels_from_config():
    spec = load_conf("dataset", "arith", arith={"level": [1, 2], "train_size": 6})
    problems = load_problems(spec, seed=1)
    assert [p.meta["level"] for p in problems] == [1, 2, 1, 2, 1, 2]
    for bad in ([], [1, 1], [0, 2], [True]):
        with pytest.raises(ConfigError, match="arith.level"):
            validate_spec(load_conf("dataset", "arith", arith={"level": bad}))


def test_arith_configs_load_and_match():
    train = load_problems(load_conf("dataset", "arith"), seed=5)
    bench_cfg = load_conf("benchmark", "arith")
    test = load_problems(bench_cfg, seed=5)
    assert len(train) == 2000 and len(test) == 20
    assert len({p.prompt for p in test}) == 20  # level 1 has exactly 20 test expressions: all distinct
    assert train[0].uid == "arith/train/0" and test[0].uid == "arith/test/0"
    assert not {p.prompt for p in train} & {p.prompt for p in test}
    # The benchmark pins its seed: the run seed does not change the test problems.
    assert load_problems(bench_cfg, seed=99) == test
    # The training set follows the run seed.
    assert load_problems(load_conf("dataset", "arith"), seed=6) != train
    assert bench_cfg.arith.level == load_conf("dataset", "arith").arith.level
    limited = load_problems(load_conf("dataset", "arith", limit=5), seed=5)
    assert limited == train[:5]


# ----------------------------------------------------------------------------- answer extraction


def test_gsm8k_answer_extraction():
    text = "She pays 3 * 400 = <<3*400=1200>>1200 dollars.\n#### 1,200"
    assert extract_answer(text, "gsm8k") == "1200"
    assert extract_answer("a #### b #### -7 ", "gsm8k") == "-7"
    assert extract_answer("no marker here", "gsm8k") is None


def test_boxed_extraction_nested_braces():
    solution = (
        "First $\\boxed{1}$ is a distraction. So the answer is "
        "$\\boxed{\\frac{\\sqrt{3}}{2} + \\left\\{ x \\right\\}}$."
    )
    assert extract_last_boxed(solution) == "\\frac{\\sqrt{3}}{2} + \\left\\{ x \\right\\}"
    assert extract_answer(solution, "boxed") == "\\frac{\\sqrt{3}}{2} + \\left\\{ x \\right\\}"
    assert extract_last_boxed("our answer is $\\boxed 2$.") == "2"
    assert extract_last_boxed("\\fbox{12}") == "12"
    assert extract_last_boxed("\\boxed{5} then \\boxed{unclosed") == "5"
    assert extract_last_boxed("nothing boxed") is None
    assert extract_answer("$\\boxed{}$", "boxed") is None


def test_raw_answers_are_strings():
    assert extract_answer(27.0, "raw") == "27.0"
    assert extract_answer(204, "raw") == "204"
    assert extract_answer(" p - q ", "raw") == "p - q"
    assert extract_answer("", "raw") is None


# ----------------------------------------------------------------------------- real local files


@needs_data
@pytest.mark.parametrize(
    ("group", "name", "split", "first_answer"),
    [
        ("dataset", "gsm8k", "train", "72"),
        ("dataset", "math", "train", None),
        ("benchmark", "gsm8k", "test", "18"),
        ("benchmark", "math500", "test", "\\left( 3, \\frac{\\pi}{2} \\right)"),
        ("benchmark", "aime24", "test", "204"),
        ("benchmark", "amc23", "test", "27.0"),
    ],
)
def test_real_files_load_via_configs(group, name, split, first_answer):
    cfg = load_conf(group, name, limit=5)
    validate_spec(cfg)
    problems = load_problems(cfg, source="local")
    assert len(problems) == 5
    assert all(isinstance(p, Problem) and p.prompt and p.answer for p in problems)
    assert all(isinstance(p.answer, str) for p in problems)
    assert all(p.uid.startswith(f"{name}/{split}/") for p in problems)
    assert len({p.uid for p in problems}) == 5
    if first_answer is not None:
        assert problems[0].answer == first_answer
    assert cfg.reward_extraction == "auto"


@needs_data
def test_math_train_boxed_answers_and_meta():
    problems = load_problems(load_conf("dataset", "math", limit=20))
    assert [p.answer for p in problems[:3]] == ["0", "98", "4"]
    for p in problems:
        assert "\\boxed" not in p.answer
        assert p.meta["level"].startswith("Level ")
        assert p.meta["type"]


@needs_data
def test_math500_meta_and_aime_ids():
    m = load_problems(load_conf("benchmark", "math500", limit=3))
    assert m[0].uid == "math500/test/0"
    assert m[0].meta["subject"] == "Precalculus" and m[0].meta["unique_id"].startswith("test/")
    a = load_problems(load_conf("benchmark", "aime24", limit=2))
    assert a[0].uid == "aime24/test/60" and a[0].meta["id"] == 60


def test_amc23_problem_field_fallback(tmp_path):
    write_jsonl(
        tmp_path / "amc" / "test.jsonl",
        [
            json.dumps({"id": 0, "problem": "P0?", "answer": 27.0}),
            json.dumps({"id": 1, "question": "Q1?", "answer": 3.5}),
        ],
    )
    cfg = load_conf("benchmark", "amc23", files={"test": "amc/test.jsonl"})
    problems = load_problems(cfg, data_dir=str(tmp_path), source="local")
    assert [p.prompt for p in problems] == ["P0?", "Q1?"]
    assert [p.answer for p in problems] == ["27.0", "3.5"]
    assert [p.uid for p in problems] == ["amc23/test/0", "amc23/test/1"]


# ----------------------------------------------------------------------------- errors


def test_missing_file_error_names_path_env_and_hub(tmp_path):
    cfg = load_conf("benchmark", "gsm8k")
    with pytest.raises(DataError) as info:
        load_problems(cfg, data_dir=str(tmp_path), source="local")
    msg = str(info.value)
    assert str(tmp_path / "gsm8k" / "test.jsonl") in msg
    assert "RLBENCH_DATA_DIR" in msg and "openai/gsm8k" in msg
    with pytest.raises(DataError) as info:
        validate_spec(cfg, data_dir=str(tmp_path), source="local")
    assert "RLBENCH_DATA_DIR" in str(info.value) and "openai/gsm8k" in str(info.value)


def test_auto_source_falls_back_to_hub_and_reports_both(tmp_path, monkeypatch):
    import sys
    import types

    def fail(*args, **kwargs):
        raise ConnectionError("offline")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=fail))
    with pytest.raises(DataError) as info:
        load_problems(load_conf("benchmark", "gsm8k"), data_dir=str(tmp_path))
    msg = str(info.value)
    assert str(tmp_path / "gsm8k" / "test.jsonl") in msg
    assert "RLBENCH_DATA_DIR" in msg and "openai/gsm8k" in msg and "offline" in msg


def test_hub_source_uses_datasets(monkeypatch):
    import sys
    import types

    calls = []

    def fake_load(hub_id, config, split):
        calls.append((hub_id, config, split))
        return [{"id": 60 + len(calls), "problem": f"p{len(calls)}", "answer": "7"}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=fake_load))
    problems = load_problems(load_conf("benchmark", "aime24"), source="hub")
    assert calls == [("HuggingFaceH4/aime_2024", None, "train")]
    assert problems[0].answer == "7" and problems[0].uid == "aime24/test/61"


def test_malformed_jsonl_reports_file_and_line(tmp_path):
    good = json.dumps({"question": "q", "answer": "1"})
    cases = {
        "bad_json": ([good, "", "{not json"], 3, "invalid JSON"),
        "not_object": ([good, "[1, 2]"], 2, "JSON object"),
        "no_answer": ([good, good, json.dumps({"question": "q"})], 3, "answer field"),
        "no_problem": ([json.dumps({"answer": "1"})], 1, "problem field"),
    }
    for label, (lines, lineno, what) in cases.items():
        path = write_jsonl(tmp_path / f"{label}.jsonl", lines)
        with pytest.raises(DataError) as info:
            load_problems(tmp_spec({"test": str(path)}), source="local")
        assert f"{path}:{lineno}" in str(info.value), label
        assert what in str(info.value), label
    path = write_jsonl(tmp_path / "gsm.jsonl", [json.dumps({"question": "q", "answer": "no marker"})])
    with pytest.raises(DataError, match=r"gsm\.jsonl:1: cannot extract"):
        load_problems(tmp_spec({"test": str(path)}, answer_format="gsm8k"), source="local")


def test_empty_lines_skipped_ids_and_limit(tmp_path):
    lines = [json.dumps({"id": f"x{i}", "question": f"q{i}", "answer": i}) for i in range(4)]
    path = write_jsonl(tmp_path / "toy.jsonl", [lines[0], "", "   ", *lines[1:]])
    problems = load_problems(tmp_spec({"test": str(path)}), source="local")
    assert [p.uid for p in problems] == ["toy/test/x0", "toy/test/x1", "toy/test/x2", "toy/test/x3"]
    assert [p.answer for p in problems] == ["0", "1", "2", "3"]
    limited = load_problems(tmp_spec({"test": str(path)}, limit=2), source="local")
    assert [p.prompt for p in limited] == ["q0", "q1"]
    # Duplicate ids fall back to positional uids.
    dup = write_jsonl(tmp_path / "dup.jsonl", [lines[0], lines[0]])
    assert [p.uid for p in load_problems(tmp_spec({"test": str(dup)}), source="local")] == [
        "toy/test/0",
        "toy/test/1",
    ]


def test_skip_bad_answers_option(tmp_path):
    lines = [
        json.dumps({"problem": "a", "solution": "so $\\boxed{1}$"}),
        json.dumps({"problem": "b", "solution": "the answer is $\\boxed{}$"}),
        json.dumps({"problem": "c", "solution": "$\\boxed{3}$"}),
    ]
    path = write_jsonl(tmp_path / "m.jsonl", lines)
    spec = tmp_spec(
        {"test": str(path)},
        fields={"problem": "problem", "answer": "solution"},
        answer_format="boxed",
    )
    with pytest.raises(DataError, match=r"m\.jsonl:2"):
        load_problems(spec, source="local")
    problems = load_problems({**spec, "skip_bad_answers": True}, source="local")
    assert [p.answer for p in problems] == ["1", "3"]
    assert [p.uid for p in problems] == ["toy/test/0", "toy/test/2"]


# ----------------------------------------------------------------------------- data dir


def test_data_dir_env_override(tmp_path, monkeypatch):
    write_jsonl(
        tmp_path / "gsm8k" / "test.jsonl",
        [json.dumps({"question": "What is 1+1?", "answer": "1+1=2\n#### 2"})],
    )
    monkeypatch.setenv("RLBENCH_DATA_DIR", str(tmp_path))
    assert resolve_data_dir() == tmp_path
    assert resolve_data_dir("/somewhere/else") == tmp_path  # the variable wins
    problems = load_problems(load_conf("benchmark", "gsm8k"), source="local")
    assert [(p.prompt, p.answer) for p in problems] == [("What is 1+1?", "2")]


def test_data_dir_configured_and_default(tmp_path):
    assert resolve_data_dir(str(tmp_path)) == tmp_path
    if DATA.is_dir():
        assert resolve_data_dir().resolve() == DATA.resolve()


def test_data_dir_missing_explains_variable(monkeypatch, tmp_path):
    from rlbench.dataset import sources

    monkeypatch.setattr(sources, "repo_root", lambda: tmp_path / "repo")
    with pytest.raises(DataError, match="RLBENCH_DATA_DIR"):
        resolve_data_dir()


# ----------------------------------------------------------------------------- prompts


def test_build_messages_with_and_without_system():
    problem = Problem(uid="t/0", prompt="What is {x}?", answer="1")
    user_only = build_messages(problem, {"system": None, "user": "Q: {problem}\nA:"})
    assert user_only == [{"role": "user", "content": "Q: What is {x}?\nA:"}]
    both = build_messages(problem, {"system": "Be brief.", "user": "{problem}"})
    assert both == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is {x}?"},
    ]


def test_build_messages_from_yaml_configs():
    problem = Problem(uid="t/0", prompt="2 + 2", answer="4")
    msgs = build_messages(problem, load_conf("dataset", "arith").prompt)
    assert msgs == [{"role": "user", "content": "Compute 2 + 2. Reply with only the final number."}]
    gsm = build_messages(problem, load_conf("dataset", "gsm8k"))  # whole spec also accepted
    assert gsm[-1]["content"].endswith("within \\boxed{}.")
    assert gsm[-1]["content"].startswith("2 + 2\n")


# ----------------------------------------------------------------------------- validate_spec


def test_validate_spec_rejects_template_without_problem():
    cfg = load_conf("dataset", "arith", prompt={"user": "Compute this."})
    with pytest.raises(ConfigError, match=r"\{problem\}"):
        validate_spec(cfg)
    cfg = load_conf("dataset", "arith", prompt={"user": "{problem} in \\boxed{}"})
    with pytest.raises(ConfigError, match="doubled"):
        validate_spec(cfg)


def test_validate_spec_rejects_unknown_answer_format_and_loader():
    with pytest.raises(ConfigError, match="answer_format"):
        validate_spec(load_conf("benchmark", "gsm8k", answer_format="last_line"))
    with pytest.raises(ConfigError, match="loader"):
        validate_spec(load_conf("benchmark", "gsm8k", loader="csv"))
    with pytest.raises(ConfigError, match="split"):
        validate_spec(load_conf("benchmark", "gsm8k"), split="train")
    with pytest.raises(ConfigError, match="level"):
        validate_spec(load_conf("dataset", "arith", arith={"level": 7}))


def test_validate_spec_file_checks(tmp_path, monkeypatch):
    from rlbench.dataset import sources

    cfg = load_conf("benchmark", "amc23")
    # auto: a missing file is fine while the Hub can be used ...
    monkeypatch.setattr(sources, "hub_reachable", lambda: True)
    validate_spec(cfg, data_dir=str(tmp_path))
    validate_spec(cfg, data_dir=str(tmp_path), source="hub")
    # ... but not when the Hub is switched off.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match="amc23/test.jsonl"):
        validate_spec(cfg, data_dir=str(tmp_path))


def test_a_missing_data_folder_or_an_unreachable_hub_is_refused_at_validation(tmp_path, monkeypatch):
    """RLBENCH_DATA_DIR (or data_dir) naming no folder is refused whatever the source could do; a
    missing file with source=auto is refused at once when the Hub does not answer (no retries later),
    and the Hub is asked once per process."""
    from rlbench.dataset import sources

    cfg = load_conf("benchmark", "gsm8k")
    monkeypatch.setattr(sources, "hub_reachable", lambda: True)
    monkeypatch.setenv("RLBENCH_DATA_DIR", str(tmp_path / "nonexistent"))
    with pytest.raises(DataError, match=r"RLBENCH_DATA_DIR=.*nonexistent is not a folder"):
        validate_spec(cfg)
    monkeypatch.delenv("RLBENCH_DATA_DIR")
    with pytest.raises(DataError, match=r"data_dir=.*nonexistent is not a folder"):
        validate_spec(cfg, data_dir=str(tmp_path / "nonexistent"))
    validate_spec(cfg, data_dir=str(tmp_path / "nonexistent"), source="hub")  # the Hub alone needs no folder
    monkeypatch.setattr(sources, "hub_reachable", lambda: False)
    with pytest.raises(DataError, match="gsm8k/test.jsonl.*does not answer"):
        validate_spec(cfg, data_dir=str(tmp_path))


def test_hub_reachable_tries_one_connection_to_the_endpoint(monkeypatch):
    import socket

    from rlbench.dataset import sources

    tried = []

    def refuse(address, timeout):
        tried.append((address, timeout))
        raise OSError("no network")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setenv("HF_ENDPOINT", "http://mirror.example:8080")
    sources.hub_reachable.cache_clear()
    try:
        assert sources.hub_reachable() is False and sources.hub_reachable() is False
    finally:
        sources.hub_reachable.cache_clear()
    assert tried == [(("mirror.example", 8080), sources.HUB_PROBE_SECONDS)]


@needs_data
def test_all_configs_validate():
    for group in ("dataset", "benchmark"):
        for path in sorted((CONF / group).glob("*.yaml")):
            cfg = OmegaConf.load(path)
            if "loader" not in cfg or path.stem.startswith("custom") or path.stem == "jsonl":
                continue  # not a dataset spec (owned elsewhere), or a template for the user's own files
            validate_spec(cfg, source="local")
            if cfg.get("answer_type") == "code":
                continue  # graded by tests, no answer extraction
            assert cfg.reward_extraction == ("last_number" if cfg.loader == "arith" else "auto")


# ---------------------------------------------------------------------------------------------
# benchmark YAML (issue 16): field paths, record fields in the prompt, tolerances, answer types,
# misspelt keys, and the two worked examples of docs/evaluation.md
# ---------------------------------------------------------------------------------------------


def _doc_examples() -> list[tuple[list[dict], dict]]:
    """(records, spec) of each worked example in docs/evaluation.md: a jsonl block, then a yaml block."""
    import re

    text = (REPO / "docs" / "evaluation.md").read_text()
    blocks = re.findall(r"```(jsonl|yaml)\n(.*?)```", text, flags=re.S)
    examples, records = [], None
    for kind, body in blocks:
        if kind == "jsonl":
            records = [json.loads(line) for line in body.splitlines() if line.strip()]
        elif records is not None:
            examples.append((records, OmegaConf.to_container(OmegaConf.create(body))))
            records = None
    return examples


def _load_example(tmp_path, records, spec):
    path = tmp_path / f"{spec['name']}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    spec = {**spec, "files": {"test": str(path)}}
    validate_spec(spec, source="local")
    return spec, load_problems(spec, source="local")


def test_docs_worked_examples_load_and_grade(tmp_path):
    from rlbench.reward import grade_completions
    from rlbench.config.schema import DatasetConfig, RewardConfig
    from rlbench.config.typed import typed_node
    from rlbench.reward.graders import make_grader
    from rlbench.rollout.engines.base import Completion

    examples = _doc_examples()
    assert len(examples) == 2
    reward = RewardConfig(name="math", tolerance=1e-6)

    def grade(spec, problem, text):
        completion = Completion(request_index=0, prompt_ids=(1,), response_ids=[1], logprobs=[0.0], finished=True, text=text)
        return grade_completions(make_grader(reward, typed_node(spec, DatasetConfig)), [problem], [completion])[0].correct

    spec, (p1, p2) = _load_example(tmp_path, *examples[0])
    assert p1.answer == r"5.89\times10^{-7}" and p1.meta["tolerance"] == 0.01 and "tolerance" not in p2.meta
    assert "Give the answer in m," in build_messages(p1, spec["prompt"])[-1]["content"]
    assert grade(spec, p1, r"\boxed{5.9\times10^{-7} m}")  # within the problem's 1%
    assert not grade(spec, p1, r"\boxed{6\times10^{-7}}")  # 1.9% off
    assert not grade(spec, p1, r"\boxed{0}")
    assert not grade(spec, p1, "The wavelength is 5.89e-7 m")  # reward_extraction: boxed
    assert grade(spec, p2, r"\boxed{9 J}") and not grade(spec, p2, r"\boxed{9.001}")  # benchmark tolerance 1e-4

    spec, (q0, q1) = _load_example(tmp_path, *examples[1])
    assert q0.answer == "E_{1}, E_{2}" and q0.uid == "levels/test/0"
    assert grade(spec, q0, r"\boxed{E_2, E_1}") and not grade(spec, q0, r"\boxed{E_1}")
    assert grade(spec, q1, r"\boxed{2, 1}") and not grade(spec, q1, r"\boxed{1, 3}")


def test_answer_field_paths(tmp_path):
    from rlbench.dataset.jsonl import field_value

    record = {"a": [{"text": "x"}, {"text": "y"}], "b": {"c": [5]}, "d.e": 1, "n": None}
    assert field_value(record, "a[0].text") == "x" and field_value(record, "a[-1].text") == "y"
    assert field_value(record, "b.c[0]") == 5 and field_value(record, "d.e") == 1
    assert field_value(record, "a[2]") is None and field_value(record, "b.z") is None and field_value(record, "n") is None
    assert field_value(record, "a[x]") is None


def test_prompt_field_missing_in_a_record_names_file_and_line(tmp_path):
    path = tmp_path / "u.jsonl"
    path.write_text(json.dumps({"problem": "p", "answer": "1", "unit": "m"}) + "\n" + json.dumps({"problem": "q", "answer": "2"}) + "\n")
    spec = {"name": "u", "files": {"test": str(path)}, "split": "test", "fields": {"problem": "problem", "answer": "answer"},
            "prompt": {"user": "{problem} in {unit}"}}
    with pytest.raises(DataError, match=r"u.jsonl:2: the prompt template names \{unit\}"):
        load_problems(spec, source="local")
    with pytest.raises(ConfigError, match="unknown placeholder"):  # the arith loader has no records
        validate_spec(load_conf("dataset", "arith", prompt={"user": "{problem} in {unit}"}))


def test_bad_tolerances_and_answer_types_refused(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"problem": "p", "answer": "1", "tol": "big"}) + "\n")
    spec = {"name": "t", "files": {"test": str(path)}, "split": "test", "fields": {"problem": "problem", "answer": "answer"}}
    with pytest.raises(DataError, match="t.jsonl:1: tolerance field 'tol' must be a number"):
        load_problems({**spec, "fields": {**spec["fields"], "tolerance": "tol"}}, source="local")
    for key, value in (("tolerance", -1), ("absolute_tolerance", "x"), ("truncated_fallback", "no"), ("allow_empty", 1)):
        with pytest.raises(ConfigError, match=key):
            validate_spec({**spec, key: value}, source="local")
    with pytest.raises(ConfigError, match="answer_type 'numbers' is unknown"):
        validate_spec({**spec, "answer_type": "numbers"}, source="local")
    for answer_type in ("math", "number", "expression", "set", "text"):
        validate_spec({**spec, "answer_type": answer_type}, source="local")


def test_misspelt_keys_are_refused_with_the_nearest_key(tmp_path, make_cfg):
    spec = OmegaConf.to_container(load_conf("benchmark", "amc23"))
    with pytest.raises(ConfigError, match="unknown key 'answer_fromat'; did you mean 'answer_format'"):
        validate_spec({**spec, "answer_fromat": "raw"}, source="hub")
    with pytest.raises(ConfigError, match="'answr' \\(did you mean 'answer'\\?\\)"):
        validate_spec({**spec, "fields": {"problem": "problem", "answr": "answer"}}, source="hub")
    from rlbench.config.walk import check_against_schema
    from rlbench.config.origin import ValueOrigins
    from rlbench.validation import registered

    cfg = make_cfg("mode=eval", "eval=custom", "+eval.benchmarks.custom.answer_fromat=raw")
    with pytest.raises(ConfigError, match="did you mean 'answer_format'"):
        check_against_schema(cfg, registered(), ValueOrigins())
