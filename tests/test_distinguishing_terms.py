"""Presets that do what they say: a loss whose distinguishing term acts only where pi_theta / pi_old
differs from 1 (registry.Needs.ratio_term) either sees ratios other than 1 in its preset (several updates
per batch, or stale data) or the run says at start-up, in one line, that the term is inactive
(rlbench.validation.notice_inactive_terms).

The notice is derived from the composed config alone (unit tests below); the integration tests run every
affected paper and algorithm preset for one step on the toy task and check that the term's metric is
above 0, or that the notice was logged and the metric is indeed 0.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))  # conftest
from conftest import ROOT, compose_config  # noqa: E402
from test_paper_presets import algorithm_of  # noqa: E402

from conftest import algorithm_from  # noqa: E402
from rlbench.algorithm.registry import POLICY_LOSSES  # noqa: E402
from rlbench.config.typed import typed_config  # noqa: E402
from rlbench.validation import notice_inactive_terms  # noqa: E402

NOTICE = "acts only where pi_theta / pi_old differs from 1"

# The toy task (conf/experiment/toy_learning.yaml) for one step, with a one-problem evaluation of 8 tokens
# (a paper preset's evaluation lengths, up to 80000 tokens, would otherwise run on the tiny model).
TOY_STEP = ["experiment=toy_learning", "dataset=arith", "trainer.steps=1", "eval.limit=1", "eval.n=1", "eval.k=[1]",
            "eval.max_new_tokens=8"]
# The preset's env=python_tool gives the random tiny model no reward (it never writes a closed code block;
# conf/experiment/toy_learning/arpo.yaml), so no advantage and no clip: its toy step runs the loss single-turn.
TOY_OVERRIDES = {"paper=aepo": ["rollout=iid", "~env", "~rollout.multi_turn"]}

# What each paper preset whose loss declares a ratio term does, and why (docs/papers.md, "Distinguishing terms").
# exercised: the paper takes several updates per batch and so does the preset; stale: the paper trains on
# stale data and so does the preset (trainer.max_staleness), so no notice, and its steps after the first k are
# stale (whether the term binds on them depends on how far the policy moved); notice: the paper's schedule
# was not found (or its setting is stale data this preset does not reproduce), so the run says the term is
# inactive.
PAPER_OUTCOMES = {
    "aepo": "exercised",  # the authors' 14B script: 8 mini-batches
    "ce_gppo": "exercised",  # the authors' scripts: 8 mini-batches
    "cispo": "exercised",  # MiniMax-M1 sec. 3.1: 16 off-policy updates per generation batch (16 mini-batches)
    "dppo": "exercised",  # PPO with dropout: PPO's 3 epochs x 4 mini-batches stand in
    "gmpo": "exercised",  # the authors' script: 8 mini-batches
    "gspo": "exercised",  # 4 mini-batches
    "hapo": "exercised",  # the authors' script: 16 mini-batches
    "intellect2": "stale",  # the paper trains on ~2-step stale data; so does the preset (trainer.max_staleness=2)
    "kl_cov": "exercised",  # the authors' script: 8 mini-batches
    "m2po": "exercised",  # the authors' script: 4 mini-batches on data 64 versions stale (trainer.max_staleness)
    "mdpo": "exercised",  # the paper's 10 SGD steps per batch
    "rec": "stale",  # the example's explorer syncs every 20 steps; so does the preset (weight_sync_every=20)
    "soft_sapo": "exercised",  # sec. 5.1 (as transcribed): 4 mini-batches per rollout batch
    "spo_simple": "exercised",  # PPO's loop with SPO's penalty: PPO's 3 epochs x 4 mini-batches stand in
}


def loss_of(preset: str) -> str:
    """The loss an algorithm preset selects in its defaults list (``- loss: <name>``)."""
    entries = (yaml.safe_load((ROOT / "conf" / "algorithm" / f"{preset}.yaml").read_text()) or {}).get("defaults", [])
    return next(entry["loss"] for entry in entries if isinstance(entry, dict) and "loss" in entry)


def affected_presets() -> list[str]:
    """``algorithm=<name>`` for every algorithm preset whose loss declares a ratio term, and ``paper=<name>`` for
    every paper preset built on one (read from the YAML files: composing all presets costs half a minute;
    the integration test composes each of these and reads the term under the preset's parameters)."""
    algorithms = sorted(path.stem for path in (ROOT / "conf" / "algorithm").glob("*.yaml")
                        if POLICY_LOSSES.needs(loss_of(path.stem)).ratio_term is not None)
    papers = sorted(path.stem for path in (ROOT / "conf" / "paper").glob("*.yaml") if algorithm_of(path.stem) in algorithms)
    return [f"paper={name}" for name in papers] + [f"algorithm={name}" for name in algorithms]


AFFECTED = affected_presets()


def test_the_affected_paper_presets_are_the_ones_whose_outcome_is_stated():
    papers = {spec.split("=", 1)[1] for spec in AFFECTED if spec.startswith("paper=")}
    assert papers == set(PAPER_OUTCOMES), "state the outcome (and why) of each paper preset in PAPER_OUTCOMES"
    # the presets the issue names are among them
    assert {"ce_gppo", "intellect2", "dppo", "spo_simple", "aepo", "m2po"} <= papers


def _notice(overrides: list[str], tmp_path: Path) -> str | None:
    cfg = compose_config(overrides, tmp_path / "run")
    return notice_inactive_terms(typed_config(cfg), algorithm_from(cfg.algorithm))


def test_notice_names_the_term_and_the_way_to_exercise_it(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="rlbench.validation"):
        line = _notice(["algorithm=dppo"], tmp_path)
    assert line is not None and "\n" not in line and [r.getMessage() for r in caplog.records] == [line]
    assert "algorithm 'dppo'" in line and "dropout" in line and NOTICE in line
    assert "algorithm.update.minibatches" in line and "trainer.max_staleness" in line


@pytest.mark.parametrize("overrides", [
    ["algorithm=dppo", "algorithm.update.minibatches=2"],  # the second mini-batch sees ratios other than 1
    ["algorithm=dppo", "algorithm.update.epochs=2"],
    ["algorithm=dppo", "trainer.max_staleness=1"],  # stale data
    ["algorithm=dppo", "mode=eval"],  # no training
    ["algorithm=dppo", "algorithm.loss.rule=surrogate_variance"],  # this rule drops tokens at ratio 1 too
    ["algorithm=grpo"],  # PPO-clip's clip is the shared trust region, not a distinguishing term
    ["algorithm=exgrpo"],  # its shaping acts on replayed tokens at their stored behaviour ratio
    ["algorithm=grpo", "algorithm/loss=dppo", "algorithm.update.schedule=sfpo"],  # K fast passes + the slow one
    ["paper=intellect2"],  # rollouts up to 2 versions stale: the delta cap can act
])
def test_no_notice_where_the_term_can_act_or_is_not_ratio_bound(tmp_path, overrides):
    assert _notice(overrides, tmp_path) is None


@pytest.mark.parametrize("overrides", [
    ["algorithm=dppo", "trainer.max_staleness=0"],  # the pipeline without overlap: still fresh data
    ["algorithm=grpo", "algorithm/loss=gspo_token"],  # a user composition, not only presets
    ["paper=intellect2", "trainer.max_staleness=null"],  # its stale data removed
])
def test_notice_where_every_ratio_is_one(tmp_path, overrides):
    assert NOTICE in (_notice(overrides, tmp_path) or "")


@pytest.mark.slow
@pytest.mark.parametrize("spec", AFFECTED)
def test_one_step_exercises_the_term_or_says_it_is_inactive(tmp_path, caplog, spec):
    """One toy step of the preset through the runner: the loss's term metric (a clip, mask or drop
    fraction, or the penalty's size) is above 0, or the start-up notice was logged and the metric is 0."""
    from rlbench.runner import run

    torch.set_num_threads(1)
    kind, name = spec.split("=", 1)
    stale = kind == "paper" and PAPER_OUTCOMES[name] == "stale"
    toy = [*TOY_STEP, *TOY_OVERRIDES.get(spec, [])]
    cfg = compose_config([spec, *toy], tmp_path / "run")
    if stale:  # past the first k steps, whose batches are sampled by version 0 and so fresh
        cfg = compose_config([spec, *toy, f"trainer.steps={cfg.trainer.max_staleness + 2}"], tmp_path / "run")
    algorithm = algorithm_from(cfg.algorithm)
    metric = POLICY_LOSSES.needs(algorithm.loss.name).ratio_term_metric
    term = POLICY_LOSSES.ratio_term(algorithm.loss.name, algorithm.loss.params)
    with caplog.at_level(logging.WARNING, logger="rlbench.validation"):
        run(cfg)
    notices = [r.getMessage() for r in caplog.records if NOTICE in r.getMessage()]
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step = steps[0]
    if stale:  # no notice, and a step trained on a batch sampled by an older policy (with weight_sync_every = j
        # > 1 the batches sampled right after a sync are fresh, so the last step need not be stale)
        assert not notices and max(s["staleness"] for s in steps) >= 1, (spec, notices, [s["staleness"] for s in steps])
        return
    if kind == "paper":
        assert ("notice" if notices else "exercised") == PAPER_OUTCOMES[name], (spec, notices, step.get(metric))
    if term is None:  # the preset's parameters make the term act at ratio 1 too (dppo's surrogate_variance rule)
        assert not notices, notices
    elif notices:
        assert len(notices) == 1, notices
        if metric is not None:  # the notice is true: the term did not act
            assert step[metric] == 0.0, (spec, metric, step[metric])
    else:
        assert metric is not None, f"{spec}: loss '{algorithm.loss.name}' declares no ratio_term_metric to show its term acted"
        assert step[metric] > 0.0, f"{spec}: {metric} = {step[metric]} after {algorithm.updates_per_batch} updates"
