"""DRPO's learned preference model (``algorithm.preference_model``; arXiv:2506.01183, section 4;
rlbench/algorithm/preference_model.py, rlbench/training/preference_model.py): a Bradley-Terry reward model fitted
on the offline data set's labelled pairs before the actor, whose preferences sigma(r_a - r_b) the dr_preference
loss reads in place of the model on the labels."""

import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import TOY_OFFLINE, compose_config  # noqa: E402
from test_preference_offline import steps as metrics  # noqa: E402

from rlbench.algorithm.losses.doubly_robust import dr_preference_loss  # noqa: E402
from rlbench.algorithm.preference_model import (  # noqa: E402
    fit_preference_model,
    labelled_pairs,
    pair_accuracy,
    scored_sequence,
)
from rlbench.algorithm.value_model import ValueModel, predict_values  # noqa: E402
from rlbench.errors import ConfigError  # noqa: E402
from rlbench.validation import validate_config  # noqa: E402

PAD = 0


def tiny_model() -> ValueModel:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, max_position_embeddings=64)
    return ValueModel(LlamaForCausalLM(config))


def test_pairs_are_the_ordered_pairs_of_a_group_with_different_labels():
    seqs = [scored_sequence((1,), (i + 2,)) for i in range(5)]
    pairs = labelled_pairs(seqs, [1.0, 0.0, 0.5, 0.5, 1.0], [0, 0, 0, 0, 1])
    got = {(p.winner.token_ids[-1], p.loser.token_ids[-1]) for p in pairs}
    # group 0: 1 > 0, 1 > 0.5 twice, 0.5 > 0 twice; the tie (0.5, 0.5) has no label; group 1 has one response
    assert got == {(2, 3), (2, 4), (2, 5), (4, 3), (5, 3)} and len(pairs) == 5
    assert scored_sequence((1, 2), (3, 4)).positions == (3,) and scored_sequence((1, 2), ()).positions == (1,)
    assert pair_accuracy([1.0, 0.0, 2.0], [0.0, 0.0, 3.0]) == pytest.approx(0.5)


def test_the_bradley_terry_fit_orders_the_labelled_pairs():
    # the preferred responses end in an even token: the model must learn which ending wins
    pairs = labelled_pairs([scored_sequence((1, 3 + g), (t,)) for g in range(4) for t in (10 + 2 * g, 11 + 2 * g)],
                           [1.0, 0.0] * 4, [0, 0, 1, 1, 2, 2, 3, 3])
    model = tiny_model()
    losses = fit_preference_model(model, pairs, PAD, epochs=40, lr=0.01, batch_size=2, generator=torch.Generator().manual_seed(0))
    assert losses[0] == pytest.approx(torch.log(torch.tensor(2.0)).item(), abs=1e-6)  # a zero head: sigma(0) everywhere
    assert losses[-1] < 0.1
    winners = predict_values(model, [p.winner for p in pairs], PAD, 4)
    losers = predict_values(model, [p.loser for p in pairs], PAD, 4)
    assert pair_accuracy([w[0] for w in winners], [loser[0] for loser in losers]) == 1.0
    again = fit_preference_model(tiny_model(), pairs, PAD, 40, 0.01, 2, torch.Generator().manual_seed(0))
    assert again == losses  # one seed, one fit
    with pytest.raises(ValueError, match="no pair"):
        fit_preference_model(model, [], PAD, 1, 0.01, 1, torch.Generator())


def test_the_loss_reads_the_learned_preferences_and_equals_the_label_model_at_scores_r_over_t():
    torch.manual_seed(1)
    logp, old, ref = (torch.randn(6, 3) * 0.1 for _ in range(3))
    mask = torch.ones(6, 3)
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 1.0, 0.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    temperature = 0.7
    on_labels, _ = dr_preference_loss(logp, old, ref, mask, rewards, groups, preference_temperature=temperature)
    learned, _ = dr_preference_loss(logp, old, ref, mask, rewards, groups, preference_scores=rewards / temperature)
    assert torch.allclose(on_labels, learned, atol=1e-6)
    other, _ = dr_preference_loss(logp, old, ref, mask, rewards, groups, preference_scores=-rewards)
    assert not torch.allclose(on_labels, other)  # a model that prefers the worse responses changes the estimate


@pytest.mark.parametrize("overrides, message", [
    (["rollout=iid"], "fitted on a fixed data set before the actor trains"),
    (["rollout=offline", "algorithm/loss=dpo"], r"only the losses \['dr_preference'\] read"),
    (["rollout=offline", "model/lora=default"], "model.lora"),
])
def test_a_preference_model_without_its_data_set_or_reader_is_refused_before_loading(make_cfg, overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(make_cfg("experiment=smoke", "algorithm=dr_preference", "algorithm.preference_model={epochs: 1}",
                                 *overrides))


def offline_overrides(traces, *extra):
    return [*TOY_OFFLINE, "algorithm=dr_preference", "rollout=offline", "guidance=jsonl", f"guidance.path={traces}",
            "guidance.keep_incorrect=true", "rollout.n=4", "trainer.prompts_per_step=2", "dataset.arith.train_size=6",
            "eval.before_training=false", *extra]


@pytest.mark.slow
def test_the_model_is_fitted_once_on_every_labelled_pair_and_read_back_by_a_run_of_its_identity(tmp_path, toy_traces):
    from rlbench.runner import run

    model = "algorithm.preference_model={epochs: 3, lr: 0.001, batch_size: 4}"
    run(compose_config(offline_overrides(toy_traces, "trainer.steps=3", model), tmp_path / "first"))
    saved = torch.load(tmp_path / "first" / "preference_model.pt", weights_only=False)["metrics"]
    assert saved["pairs"] >= 6  # every labelled pair of the 6 prompts' 4 responses, not one step's
    assert saved["loss_after"] < saved["loss_before"] == pytest.approx(0.6931, abs=1e-3)
    rows = metrics(tmp_path / "first")
    without = metrics_of_run(run, tmp_path / "labels", offline_overrides(toy_traces, "trainer.steps=3"))
    assert [r["policy_loss"] for r in rows] != [r["policy_loss"] for r in without]  # the learned model is read
    # the same identity: the file is read, not refitted, and the run trains the same steps
    stamp = (tmp_path / "first" / "preference_model.pt").stat().st_mtime_ns
    path = tmp_path / "first" / "preference_model.pt"
    second = metrics_of_run(run, tmp_path / "second", offline_overrides(
        toy_traces, "trainer.steps=3", f"algorithm.preference_model={{epochs: 3, lr: 0.001, batch_size: 4, path: {path}}}"))
    assert path.stat().st_mtime_ns == stamp and not (tmp_path / "second" / "preference_model.pt").exists()
    assert [r["policy_loss"] for r in second] == [r["policy_loss"] for r in rows]


def metrics_of_run(run, run_dir, overrides):
    run(compose_config(overrides, run_dir))
    return metrics(run_dir)


@pytest.mark.slow
def test_resume_continues_with_the_model_it_started_with(tmp_path, toy_traces):
    from test_resume import RESULT_FILES, metrics_without_timing, run_and_resume_from_step_2

    overrides = offline_overrides(toy_traces, "trainer.steps=4", "trainer.checkpoint_every=2", "eval.every=2",
                                  "trainer.save_model=false", "algorithm.preference_model={epochs: 2, lr: 0.001}")
    reference, resumed = run_and_resume_from_step_2(overrides, tmp_path)
    run_bound = ("peak_memory_mb", "reference_cache_hits", "reference_cache_misses")  # as in test_step_critic
    assert [{k: v for k, v in r.items() if k not in run_bound} for r in metrics_without_timing(resumed)] == \
        [{k: v for k, v in r.items() if k not in run_bound} for r in metrics_without_timing(reference)]
    for name in RESULT_FILES:
        assert (resumed / name).read_bytes() == (reference / name).read_bytes(), name
