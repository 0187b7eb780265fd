"""An evaluation suite cannot change a benchmark's score: per-problem random streams, empty
benchmarks refused or marked, skip counts and extraction beside the scores (issue 16)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import model_preset

from rlbench.config.typed import typed_config
from rlbench.dataset import load_problems
from rlbench.dataset.base import Problem
from rlbench.errors import DataError
from rlbench.eval.evaluate import (
    Benchmark,
    evaluate,
    finish_rates,
    problem_seed,
    usable_problems,
)
from rlbench.model import load_policy
from rlbench.reward import MathReward
from rlbench.rollout.engines.base import GenerationRequest, SamplingParams
from rlbench.rollout.engines.hf import HFGenerateEngine

ROOT = Path(__file__).resolve().parents[1]
PARAMS = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=6)


@pytest.fixture(scope="module")
def engine_and_tokenizer():
    model, tokenizer = load_policy(model_preset("tiny"), seed=0)
    return HFGenerateEngine(model, tokenizer, batch_size=64, progress=False), tokenizer


def _benchmark(name: str, size: int) -> Benchmark:
    problems = [Problem(uid=f"{name}/test/{i}", prompt=f"{i} + {i}", answer=str(2 * i)) for i in range(size)]
    spec = {"name": name, "prompt": {"system": None, "user": "Compute {problem}."}}
    return Benchmark(name, spec, problems, MathReward(extraction="last_number"))


def _run(engine_and_tokenizer, benchmarks, seed=7):
    engine, tokenizer = engine_and_tokenizer
    return evaluate(engine, tokenizer, benchmarks, n=4, ks=[1, 2], params=PARAMS, seed=seed, chunk_prompts=3)


def test_suite_does_not_change_a_benchmarks_samples(engine_and_tokenizer):
    alone = _run(engine_and_tokenizer, [_benchmark("b", 5)])
    in_suite = _run(engine_and_tokenizer, [_benchmark("a", 4), _benchmark("b", 5)])
    after = _run(engine_and_tokenizer, [_benchmark("b", 5), _benchmark("a", 4)])

    def of_b(result):
        return [(s["prompt_id"], s["completion"]) for s in result.samples if s["benchmark"] == "b"]

    assert of_b(alone) == of_b(in_suite) == of_b(after)
    assert len(set(of_b(alone))) > 1  # really sampled, not one repeated string
    rows_b = [[r for r in result.rows if r["benchmark"] == "b"] for result in (alone, in_suite, after)]
    assert rows_b[0] == rows_b[1] == rows_b[2]  # pass@k, intervals, maj@k: the same table rows


def test_finish_rates_tell_cut_off_samples_from_wrong_answers(engine_and_tokenizer):
    """finished_share: samples that ended within the budget; finished_accuracy: the right share of
    those; every table row carries its benchmark's (the macro row: all samples')."""
    samples = [{"finished": True, "correct": True}, {"finished": True, "correct": False},
               {"finished": False, "correct": False}, {"finished": False, "correct": True}]
    assert finish_rates(samples) == {"finished_share": 0.5, "finished_accuracy": 0.5}
    cut_off = finish_rates(samples[2:])
    assert cut_off["finished_share"] == 0.0 and cut_off["finished_accuracy"] != cut_off["finished_accuracy"]  # NaN
    result = _run(engine_and_tokenizer, [_benchmark("a", 4), _benchmark("b", 5)])
    for row in result.rows:
        own = [s for s in result.samples if row["benchmark"] in ("macro_avg", s["benchmark"])]
        expected = finish_rates(own)
        assert row["finished_share"] == expected["finished_share"], row
        assert row["finished_accuracy"] == pytest.approx(expected["finished_accuracy"], nan_ok=True), row


def test_seed_and_benchmark_name_change_the_samples(engine_and_tokenizer):
    base = [s["completion"] for s in _run(engine_and_tokenizer, [_benchmark("b", 3)]).samples]
    other_seed = [s["completion"] for s in _run(engine_and_tokenizer, [_benchmark("b", 3)], seed=8).samples]
    assert base != other_seed
    assert problem_seed(7, "b", "b/test/0") != problem_seed(7, "c", "b/test/0")
    assert problem_seed(7, "b", "b/test/0") == problem_seed(7, "b", "b/test/0")


def test_request_seed_makes_a_sample_independent_of_its_batch(engine_and_tokenizer):
    engine, tokenizer = engine_and_tokenizer
    prompt = tuple(tokenizer.encode("1 + 1 ="))
    other = tuple(tokenizer.encode("a much longer prompt that pads the batch differently"))
    alone = engine.generate([GenerationRequest(prompt, n=2, seed=11)], PARAMS)
    batched = engine.generate([GenerationRequest(other, n=3, seed=5), GenerationRequest(prompt, n=2, seed=11)], PARAMS)
    assert [c.response_ids for c in alone[0]] == [c.response_ids for c in batched[1]]
    with pytest.raises(ValueError, match="own seed"):
        engine.generate([GenerationRequest(prompt, seed=1), GenerationRequest(prompt)], PARAMS)


def test_generator_path_unchanged_without_request_seeds(engine_and_tokenizer):
    """Training rollouts (no request seed) still follow the call's generator."""
    engine, tokenizer = engine_and_tokenizer
    prompt = tuple(tokenizer.encode("1 + 1 ="))
    runs = [engine.generate([GenerationRequest(prompt, n=3)], PARAMS, generator=torch.Generator().manual_seed(3)) for _ in range(2)]
    assert [c.response_ids for c in runs[0][0]] == [c.response_ids for c in runs[1][0]]


def test_empty_benchmark_is_refused_or_marked(engine_and_tokenizer):
    with pytest.raises(DataError, match="no usable problems: all 3 records were skipped.*allow_empty"):
        usable_problems("x", [], {}, skipped=3)
    assert usable_problems("x", [], {"allow_empty": True}) == []
    empty = Benchmark("x", {"prompt": {"user": "{problem}"}, "allow_empty": True}, [], MathReward(), skipped=2)
    result = _run(engine_and_tokenizer, [_benchmark("b", 2), empty, _benchmark("c", 1)])
    rows_x = [r for r in result.rows if r["benchmark"] == "x"]
    assert [r["k"] for r in rows_x] == [1, 2]
    assert all(r["empty"] and r["problems"] == 0 and r["skipped"] == 2 and r["pass_at_k"] != r["pass_at_k"] for r in rows_x)
    assert result.pass_at(1)["x"] is None and result.skipped == {"b": 0, "x": 2, "c": 0}
    assert [r["benchmark"] for r in result.rows] == ["b", "b", "x", "x", "c", "c", "macro_avg", "macro_avg"]
    assert all(r["problems"] == 3 for r in result.rows if r["benchmark"] == "macro_avg")  # x left out


def test_samples_show_the_extraction_of_truncated_responses(engine_and_tokenizer):
    result = _run(engine_and_tokenizer, [_benchmark("b", 2)])
    assert all({"extraction", "finished"} <= set(s) for s in result.samples)
    json.dumps(result.samples)  # samples.jsonl stays plain JSON


def test_truncated_fallback_is_a_stated_choice():
    text = "so far 3 + 4 = 7 and then"
    lenient = MathReward(truncated_fallback=True)
    strict = MathReward(truncated_fallback=False)
    assert lenient(text, "7", finished=False).correct and lenient(text, "7", finished=False).extraction == "last_number"
    cut = strict(text, "7", finished=False)
    assert not cut.correct and cut.extracted is None and cut.extraction is None
    assert strict(text, "7", finished=True).correct  # a finished response keeps the fallbacks
    assert strict(r"so \boxed{7} and then", "7", finished=False).extraction == "boxed"


def test_skip_counts_reach_the_loader_result(tmp_path):
    data = tmp_path / "m.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [{"problem": "p", "solution": "no box"}, {"problem": "q", "solution": r"\boxed{2}"}]))
    spec = {"name": "m", "files": {"test": str(data)}, "split": "test", "fields": {"problem": "problem", "answer": "solution"},
            "answer_format": "boxed", "skip_bad_answers": True}
    problems = load_problems(spec, source="local")
    assert len(problems) == 1 and problems.skipped == 1


def test_runner_refuses_an_empty_benchmark_before_the_model_loads(tmp_path, make_cfg, monkeypatch):
    from rlbench import runner

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    cfg = make_cfg("mode=eval", "model=tiny", "eval=custom", f"eval.benchmarks.custom.files.test={empty}")
    monkeypatch.setattr(runner, "load_policy", lambda *a, **k: pytest.fail("the model must not load"))
    with pytest.raises(DataError, match="'custom' has no usable problems: the source has no records"):
        runner.run(cfg)
    allowed = make_cfg("mode=eval", "eval=custom", f"eval.benchmarks.custom.files.test={empty}", "eval.benchmarks.custom.allow_empty=true")
    (bench,) = runner.load_benchmarks(allowed, typed_config(allowed))
    assert bench.problems == [] and bench.skipped == 0


def test_engine_reports_the_whole_token_budget_while_decoding(engine_and_tokenizer):
    """SamplingParams.on_budget: the reports add up to max_new_tokens per sample (sampled tokens plus
    the unused rest of the samples that ended), and arrive step by step, not once at the end."""
    engine, tokenizer = engine_and_tokenizer
    reports: list[int] = []
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=6, on_budget=reports.append)
    requests = [GenerationRequest(prompt_ids=tokenizer.encode(f"{i} + {i}"), n=3, seed=i) for i in range(4)]
    engine.generate(requests, params)
    assert sum(reports) == 4 * 3 * params.max_new_tokens
    assert len(reports) > 1 and all(r > 0 for r in reports)


def test_evaluation_shows_progress_with_an_eta_while_a_chunk_decodes(engine_and_tokenizer, capsys):
    """One chunk holds every problem: lines with an ETA appear before any problem is done (the
    progress counts token slots of the budget, not finished chunks), and the last says all are done."""
    engine, tokenizer = engine_and_tokenizer
    evaluate(engine, tokenizer, [_benchmark("b", 5)], n=2, ks=[1], params=PARAMS, seed=0, chunk_prompts=16,
             progress_interval=0.0)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[eval: token budget]")]
    during = [line for line in lines if "b: 0/5 problems done" in line]
    assert during and any("ETA --:--" not in line for line in during), lines
    assert lines[-1].startswith(f"[eval: token budget] {5 * 2 * PARAMS.max_new_tokens}/{5 * 2 * PARAMS.max_new_tokens} (100%)")
    assert lines[-1].endswith("b: 5/5 problems done")
