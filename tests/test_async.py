"""Asynchronous training with bounded staleness (rlbench/training/async_pipeline.py): the version rule,
the staleness gate, the weight snapshots, the refusals, and end to end: max_staleness=0 equals the
synchronous run, a stale run trains on stored behaviour log-probs and repeats itself under a seed."""

import json
import threading

import pytest
import torch

from rlbench.config import validate_config
from rlbench.errors import ConfigError
from rlbench.training.async_pipeline import StalenessGate, WeightSnapshots, generator_version
from rlbench.training.step import TIMING_METRICS


def test_batch_s_is_sampled_by_version_s_minus_1_minus_k():
    assert [generator_version(s, 0) for s in range(1, 6)] == [0, 1, 2, 3, 4]
    assert [generator_version(s, 2) for s in range(1, 6)] == [0, 0, 0, 1, 2]
    # the learner trains batch s at version s - 1: staleness never exceeds k
    for k in range(4):
        assert all(0 <= (s - 1) - generator_version(s, k) <= k for s in range(1, 20))


def test_the_gate_never_admits_a_batch_older_than_the_bound_and_keeps_versions_monotone():
    gate = StalenessGate(max_staleness=2)
    assert gate.admit(batch_version=3, learner_version=5)
    assert not gate.admit(batch_version=2, learner_version=5)  # 3 behind
    assert not gate.admit(batch_version=6, learner_version=5)  # from the future
    assert gate.admit(batch_version=4, learner_version=5)
    assert not gate.admit(batch_version=3, learner_version=4)  # within the bound but older than the last admitted
    assert gate.dropped == 3 and gate.last_version == 4


def test_snapshots_are_copies_read_in_version_order():
    snapshots, model = WeightSnapshots(), torch.nn.Linear(2, 1)
    snapshots.publish(0, model)
    with torch.no_grad():
        model.weight.add_(1.0)
    snapshots.publish(1, model)
    first = snapshots.take(0)
    assert not torch.equal(first["weight"], model.weight) and snapshots.take(0) is first  # version 0 read twice
    assert torch.equal(snapshots.take(1)["weight"], model.weight) and 0 not in snapshots.snapshots
    waiting = threading.Thread(target=lambda: result.append(snapshots.take(5)))
    result = []
    waiting.start()
    snapshots.close()
    waiting.join(timeout=30)
    assert result == [None]


@pytest.mark.parametrize("overrides, message", [
    (["algorithm=gpg"], "needs on-policy data: loss 'reinforce'"),
    (["algorithm=pvpo"], "samples baseline rollouts at the learner"),
    (["trainer.stages=[{at:2,rollout.n:4}]"], "trainer.stages would change"),
    (["eval.every=1"], "eval.every evaluates during training"),
])
def test_stale_training_refuses_what_needs_fresh_data_naming_it(make_cfg, overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(make_cfg("experiment=smoke", "trainer.steps=3", "trainer.max_staleness=1", *overrides))
    validate_config(make_cfg("experiment=smoke", "trainer.steps=3", "trainer.max_staleness=0", *overrides))  # 0: fresh data


def run_metrics(make_cfg, tmp_path, name, *overrides):
    from conftest import compose_config
    from rlbench.runner import run

    run(compose_config(["experiment=smoke", "trainer.steps=3", "eval.before_training=false", "logger=files", *overrides],
                       tmp_path / name))
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return rows, json.loads((tmp_path / name / "summary.json").read_text())


@pytest.mark.slow
def test_max_staleness_zero_equals_the_synchronous_run_and_a_stale_run_uses_stored_logprobs(make_cfg, tmp_path):
    sync, _ = run_metrics(make_cfg, tmp_path, "sync")
    zero, _ = run_metrics(make_cfg, tmp_path, "zero", "trainer.max_staleness=0")
    for a, b in zip(sync, zero, strict=True):
        assert {k: v for k, v in a.items() if k not in TIMING_METRICS} == \
               {k: v for k, v in b.items() if k not in TIMING_METRICS | {"staleness"}}
        assert b["staleness"] == 0
    stale, summary = run_metrics(make_cfg, tmp_path, "stale", "trainer.max_staleness=1")
    again, _ = run_metrics(make_cfg, tmp_path, "again", "trainer.max_staleness=1")
    assert [r["staleness"] for r in stale] == [0, 1, 1] and summary["async_dropped_batches"] == 0
    assert [r.get("off_policy_token_fraction") for r in stale] == [None, 1.0, 1.0]
    # pi_old of a stale token is its stored sampling log-prob: the ratio is pi_theta / mu, not 1
    assert sync[1]["ratio_mean"] == 1.0 and stale[1]["ratio_mean"] != 1.0
    for a, b in zip(stale, again, strict=True):  # a function of the seed, whatever the threads' timing
        assert {k: v for k, v in a.items() if k not in TIMING_METRICS} == {k: v for k, v in b.items() if k not in TIMING_METRICS}
