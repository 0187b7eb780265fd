"""Asynchronous training with bounded staleness (rlbench/training/async_pipeline.py): the version rule,
the staleness gate, the weight snapshots, the refusals, and end to end: max_staleness=0 equals the
synchronous run, a stale run trains on stored behaviour log-probs and repeats itself under a seed."""

import json
import threading

import pytest
import torch

from rlbench.validation import validate_config
from rlbench.errors import ConfigError
from rlbench.training.async_pipeline import StalenessGate, WeightSnapshots, generator_version
from rlbench.training.step import TIMING_METRICS


def test_batch_s_is_sampled_by_version_s_minus_1_minus_k():
    assert [generator_version(s, 0) for s in range(1, 6)] == [0, 1, 2, 3, 4]
    assert [generator_version(s, 2) for s in range(1, 6)] == [0, 0, 0, 1, 2]
    # the learner trains batch s at version s - 1: staleness never exceeds k
    for k in range(4):
        assert all(0 <= (s - 1) - generator_version(s, k) <= k for s in range(1, 20))


@pytest.mark.parametrize("k", range(5))
def test_syncing_every_j_versions_rounds_g_up_to_a_multiple_of_j_within_the_bound(k):
    for j in range(1, k + 2):
        versions = [generator_version(s, k, j) for s in range(1, 40)]
        assert all(v % j == 0 for v in versions) and versions == sorted(versions)  # synced versions, monotone
        for s, v in enumerate(versions, start=1):
            assert v == j * -(-max(0, s - 1 - k) // j)  # g(s) rounded up to a multiple of j
            assert 0 <= (s - 1) - v <= k  # exists when batch s is due; never staler than the gate allows
            assert StalenessGate(k).admit(batch_version=v, learner_version=s - 1)
    assert [generator_version(s, k, 1) for s in range(1, 40)] == [generator_version(s, k) for s in range(1, 40)]
    with pytest.raises(ValueError, match="sync_every must be in 1"):
        generator_version(1, k, k + 2)


def test_syncing_every_2_versions_with_bound_3_by_hand():
    # g(s) = max(0, s - 4) = 0 0 0 0 1 2 3 4; rounded up to even: 0 0 0 0 2 2 4 4
    assert [generator_version(s, 3, 2) for s in range(1, 9)] == [0, 0, 0, 0, 2, 2, 4, 4]
    assert [(s - 1) - generator_version(s, 3, 2) for s in range(1, 9)] == [0, 1, 2, 3, 2, 3, 2, 3]


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


@pytest.mark.parametrize("overrides, message", [
    (["trainer.max_staleness=1", "trainer.weight_sync_every=3"], r"weight_sync_every <= max_staleness \+ 1"),
    (["trainer.max_staleness=0", "trainer.weight_sync_every=2"], "set trainer.max_staleness >= 1"),
    (["trainer.weight_sync_every=2"], "runs no generator thread"),
])
def test_a_sync_interval_the_staleness_bound_cannot_hold_is_refused(make_cfg, overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(make_cfg("experiment=smoke", "trainer.steps=3", *overrides))
    validate_config(make_cfg("experiment=smoke", "trainer.steps=3", "trainer.max_staleness=2", "trainer.weight_sync_every=3"))


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


@pytest.mark.slow
def test_weight_sync_every_1_is_the_default_run_and_every_2_syncs_only_even_versions(make_cfg, tmp_path):
    default, _ = run_metrics(make_cfg, tmp_path, "default", "trainer.max_staleness=1")
    one, summary_one = run_metrics(make_cfg, tmp_path, "one", "trainer.max_staleness=1", "trainer.weight_sync_every=1")
    for a, b in zip(default, one, strict=True):
        assert {k: v for k, v in a.items() if k not in TIMING_METRICS} == {k: v for k, v in b.items() if k not in TIMING_METRICS}
    assert summary_one["async_weight_syncs"] == 2  # versions 0, 1 (g = 0 0 1)
    # k = 1, j = 2: g = 0 0 1 rounded up to even = 0 0 2: batch 3 waits for version 2 (fresh)
    two, summary = run_metrics(make_cfg, tmp_path, "two", "trainer.max_staleness=1", "trainer.weight_sync_every=2")
    assert [r["staleness"] for r in two] == [0, 1, 0]
    assert summary["weight_sync_every"] == 2 and summary["async_weight_syncs"] == 2 and summary["async_dropped_batches"] == 0
