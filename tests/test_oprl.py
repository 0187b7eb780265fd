"""OPRL (arXiv:2509.19199): the implicit PRM's trajectory DPO loss and its online update, the telescoping of its step
rewards, the advantage (omega = 0 is GRPO; a hand-computed example) and a run through the runner that trains the PRM
and resumes exactly (rlbench/algorithm/advantages/oprl.py, rlbench/training/online_prm.py); single-turn responses cut
into paragraph steps (algorithm.online_prm.steps=paragraphs), by hand and through a run."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers

from conftest import compose_config
from rlbench.algorithm.advantages.group_relative import grpo_advantage
from rlbench.algorithm.advantages.oprl import (
    implicit_dpo_loss,
    oprl_advantage,
    outcome_pairs,
    step_implicit_rewards,
    trajectory_implicit_rewards,
)
from rlbench.config.schema import OnlinePRMConfig
from rlbench.errors import ConfigError
from rlbench.training.batch import TrainBatch
from rlbench.training.forward import batch_outputs
from rlbench.training.online_prm import OnlinePRM, paragraph_step_index, paragraph_steps
from test_gigpo import episodes


def test_dpo_loss_is_lower_when_the_winner_is_ranked_higher():
    pairs = [(0, 1)]
    right = implicit_dpo_loss(torch.tensor([1.0, 0.0]), pairs)
    wrong = implicit_dpo_loss(torch.tensor([0.0, 1.0]), pairs)
    assert right.item() == pytest.approx(math.log1p(math.exp(-1.0)))  # -log sigma(1)
    assert wrong.item() == pytest.approx(math.log1p(math.exp(1.0)))
    assert right < implicit_dpo_loss(torch.tensor([0.0, 0.0]), pairs) < wrong
    # the loss averages over the pairs, or over the caller's total when the pairs are split
    assert implicit_dpo_loss(torch.tensor([1.0, 0.0, 0.0]), [(0, 1), (0, 2)], normaliser=4).item() == pytest.approx(right.item() / 2)


def test_outcome_pairs_rank_within_groups_only():
    rewards = torch.tensor([1.0, 0.0, 0.0, 2.0, 1.0])
    groups = torch.tensor([0, 0, 0, 1, 1])
    assert outcome_pairs(rewards, groups) == [(0, 1), (0, 2), (3, 4)]
    assert outcome_pairs(torch.ones(4), torch.tensor([0, 0, 1, 1])) == []  # equal outcomes: no preference


def test_step_rewards_telescope_to_the_trajectory_implicit_reward():
    generator = torch.Generator().manual_seed(0)
    # 2 episodes: turns of 2, 1, 1 policy tokens with observations between; padding at the end of the second
    mask, step, _, _ = episodes([[(0, 0.0, 2, 1), (0, 0.0, 1, 2), (0, 0.0, 1, 0)], [(0, 0.0, 3, 1), (0, 0.0, 2, 0)]], 9)
    prm, ref = torch.randn(2, 9, generator=generator), torch.randn(2, 9, generator=generator)
    beta = 0.05
    per_token = step_implicit_rewards(prm, ref, step, mask, beta)
    inside = (mask > 0) & (step >= 0)
    for row in range(2):
        steps = sorted(set(step[row][inside[row]].tolist()))
        first = [int(((step[row] == k) & inside[row]).nonzero()[0]) for k in steps]
        step_sum = sum(float(per_token[row, at]) for at in first)
        log_ratio = float(((prm[row].double() - ref[row].double()) * inside[row]).sum())  # log pi_phi(tau) - log pi_ref(tau)
        assert step_sum == pytest.approx(beta * log_ratio, abs=1e-9)
        assert float(trajectory_implicit_rewards(prm, ref, step, mask, beta)[row]) == pytest.approx(beta * log_ratio, abs=1e-6)
        # one value per step on its tokens: turn 0 of episode 0 is tokens 0, 1
    assert float(per_token[0, 0]) == float(per_token[0, 1]) == pytest.approx(beta * float((prm[0, :2] - ref[0, :2]).sum()))
    assert float(per_token[0, 2]) == 0.0 and float(per_token[1, 8]) == 0.0  # an observation token and padding


def test_omega_zero_is_grpo_exactly():
    mask, step, _, _ = episodes([[(0, 0.0, 2, 1), (0, 0.0, 1, 0)], [(0, 0.0, 1, 1), (0, 0.0, 2, 0)],
                                 [(0, 0.0, 3, 0)], [(0, 0.0, 1, 1), (0, 0.0, 1, 0)]], 6)
    rewards, groups = torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1])
    process = torch.randn(4, 6, generator=torch.Generator().manual_seed(1)).double()
    adv = oprl_advantage(rewards, groups, mask, step, process, omega=0.0)
    assert torch.equal(adv, grpo_advantage(rewards, groups, mask) * mask)


def test_hand_computed_step_advantage():
    # one group: episode 0 has turns with r_phi 0.3, 0.1; episode 1 one turn with r_phi -0.1; outcomes 1, 0
    mask, step, _, _ = episodes([[(0, 0.0, 2, 1), (0, 0.0, 1, 0)], [(0, 0.0, 2, 0)]], 4)
    process = torch.zeros(2, 4, dtype=torch.float64)
    process[0, 0:2], process[0, 3], process[1, 0:2] = 0.3, 0.1, -0.1
    adv = oprl_advantage(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), mask, step, process, omega=0.5, epsilon=0.0)
    a_e = 2 ** -0.5  # (1 - 0.5) / std([1, 0]), unbiased std sqrt(1/2)
    steps = torch.tensor([0.3, 0.1, -0.1], dtype=torch.float64)
    a_s = ((steps - steps.mean()) / steps.std()).tolist()  # over every step of the group
    expected = torch.tensor([[a_e + 0.5 * a_s[0]] * 2 + [0.0, a_e + 0.5 * a_s[1]],
                             [-a_e + 0.5 * a_s[2]] * 2 + [0.0, 0.0]], dtype=torch.float64)
    assert torch.allclose(adv.double(), expected, atol=1e-6)


def tiny_lm(seed: int) -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def pair_batch() -> TrainBatch:
    """One group of two 2-turn episodes (prompt 2 tokens; turn, observation, turn): the first won."""
    ids = torch.tensor([[1, 2, 5, 6, 9, 7], [1, 2, 3, 4, 9, 8]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 0.0, 1.0]])
    step = torch.tensor([[0, 0, -1, 1], [0, 0, -1, 1]])
    return TrainBatch(input_ids=ids, attention_mask=torch.ones_like(ids), response_mask=mask, prompt_width=2,
                      group_index=torch.tensor([0, 0]), rewards=torch.tensor([1.0, 0.0]), extras={"step_index": step})


def test_one_prm_update_ranks_the_winner_higher_and_leaves_the_reference_alone():
    reference = tiny_lm(0)
    before = {k: v.clone() for k, v in reference.state_dict().items()}
    batch = pair_batch()
    batch.ref_logp = batch_outputs(reference, batch, 2, 1.0).logp
    prm = OnlinePRM.from_reference(OnlinePRMConfig(beta=0.1, lr=1e-2, updates=1), reference, 2, 1.0)
    rewards, first = prm.step_rewards(batch)
    assert torch.equal(rewards, torch.zeros_like(rewards))  # pi_phi = pi_ref at the start: r_phi = 0
    assert first["prm_loss_after"] == pytest.approx(math.log(2.0))
    metrics = prm.update(batch)
    assert metrics["prm_pairs"] == 1.0 and metrics["prm_loss"] == pytest.approx(math.log(2.0))
    rewards, after = prm.step_rewards(batch)
    assert after["prm_loss_after"] < math.log(2.0) and after["prm_pair_accuracy"] == 1.0
    winner, loser = rewards[0, 0] + rewards[0, 3], rewards[1, 0] + rewards[1, 3]  # sum of each episode's steps
    assert winner > loser
    assert all(torch.equal(v, before[k]) for k, v in reference.state_dict().items())
    assert not all(torch.equal(v, before[k]) for k, v in prm.model.state_dict().items())



def test_the_policy_baseline_takes_the_implicit_reward_against_the_sampling_policy():
    initial, policy = tiny_lm(0), tiny_lm(1)  # the policy has moved away from the PRM's start
    batch = pair_batch()
    prm = OnlinePRM.from_reference(OnlinePRMConfig(beta=0.1, lr=1e-2, baseline="policy"), initial, 2, 1.0, policy=policy)
    scored = prm.scored(batch)
    assert batch.ref_logp is None  # the batch itself is left as it was
    rewards, _ = prm.step_rewards(scored)
    ratio = batch_outputs(initial, batch, 2, 1.0).logp - batch_outputs(policy, batch, 2, 1.0).logp
    assert float(rewards[0, 0]) == pytest.approx(0.1 * float(ratio[0, :2].sum()), abs=1e-6)  # turn 0: tokens 0, 1
    assert float(rewards[1, 3]) == pytest.approx(0.1 * float(ratio[1, 3]), abs=1e-6)
    batch.old_logp = torch.zeros(2, 4)  # the step's pi_old, when it has them, is read instead of a pass
    assert torch.equal(prm.scored(batch).ref_logp, batch.old_logp)

def test_refused_before_the_model_loads(tmp_path):
    from rlbench.validation import validate_config

    with pytest.raises(ConfigError, match="algorithm.online_prm"):
        validate_config(compose_config(["experiment=smoke", "algorithm=oprl", "algorithm.online_prm=null"], tmp_path))
    with pytest.raises(ConfigError, match="remove algorithm.online_prm"):
        validate_config(compose_config(["experiment=smoke", "algorithm=oprl", "algorithm/advantage=grpo"], tmp_path))
    with pytest.raises(ConfigError, match="model.lora"):
        validate_config(compose_config(["experiment=smoke", "algorithm=oprl", "model/lora=default"], tmp_path))
    with pytest.raises(ConfigError, match="algorithm.online_prm.baseline must be"):
        validate_config(compose_config(["experiment=smoke", "algorithm=oprl", "algorithm.online_prm.baseline=old"], tmp_path))
    with pytest.raises(ConfigError, match="step_index"):  # no step structure: single-turn responses
        validate_config(compose_config(["experiment=smoke", "algorithm=oprl", "rollout=iid", "~env"], tmp_path))
    single_turn = ["experiment=smoke", "algorithm=oprl", "rollout=iid", "~env", "algorithm.online_prm.steps=paragraphs"]
    validate_config(compose_config(single_turn, tmp_path))  # ... which paragraph steps give
    with pytest.raises(ConfigError, match="gives its own steps"):
        validate_config(compose_config(["experiment=smoke", "algorithm=oprl", "algorithm.online_prm.steps=paragraphs"], tmp_path))
    with pytest.raises(ConfigError, match="online_prm.steps must be"):
        validate_config(compose_config(["experiment=smoke", "algorithm=oprl", "algorithm.online_prm.steps=sentences"], tmp_path))


def test_paragraph_steps_cut_a_response_after_each_blank_line_that_more_text_follows():
    pieces = ["First", " step", ".\n\n", "Second", "\n", "still", "\n \n\n", "Third", "\n\n"]
    assert paragraph_steps(pieces) == [0, 0, 0, 1, 1, 1, 1, 2, 2]  # a single newline and trailing blank lines: no step
    assert paragraph_steps(["a\n\nb", "c", "\n", "\n", "d"]) == [0, 1, 1, 1, 2]  # a break inside a token; split over two
    assert paragraph_steps(["no breaks"]) == [0] and paragraph_steps([]) == []

    class Chars:
        def decode(self, ids, skip_special_tokens=False):
            return "".join(chr(i) for i in ids)

    mask = torch.ones(2, 6)
    index = paragraph_step_index([[ord(c) for c in "ab\n\ncd"], [ord(c) for c in "x\n\ny"]], Chars(), mask)
    assert index.tolist() == [[0, 0, 0, 0, 1, 1], [0, 0, 0, 1, -1, -1]]


def test_a_single_turn_run_trains_the_prm_on_paragraph_steps(tmp_path, monkeypatch):
    from rlbench.runner import run
    from rlbench.training import advantage_inputs

    seen = []
    original = advantage_inputs.paragraph_step_index

    def recording(responses, tokenizer, like):
        index = original(responses, tokenizer, like)
        seen.append(index)
        return index

    monkeypatch.setattr(advantage_inputs, "paragraph_step_index", recording)
    overrides = ["experiment=toy_learning", "algorithm=oprl", "rollout=iid", "~env", "algorithm.online_prm.steps=paragraphs",
                 "algorithm.online_prm.lr=1e-3", "trainer.steps=3", "eval.before_training=false", "eval.limit=2",
                 "logger=files", "trainer.save_model=false"]
    run(compose_config(overrides, tmp_path))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(seen) == 3 and all(int(index.max()) >= 0 for index in seen)
    assert sum(r["prm_pairs"] for r in rows) > 0 and all(math.isfinite(r["prm_loss"]) for r in rows if r["prm_pairs"])



def test_the_memory_check_counts_the_prm_as_a_trained_model(tmp_path, monkeypatch):
    import rlbench.validation as validation
    from rlbench.config.fit import memory_needed_bytes

    counted = []
    monkeypatch.setattr(validation, "check_fits_here",
                        lambda *a, frozen_models, trained_models=0, **k: counted.append((frozen_models, trained_models)))
    validation.validate_config(compose_config(["experiment=smoke", "algorithm=oprl"], tmp_path))
    validation.validate_config(compose_config(["experiment=smoke", "algorithm=oprl", "algorithm.online_prm.baseline=policy"], tmp_path))
    validation.validate_config(compose_config(["experiment=smoke", "algorithm=gigpo"], tmp_path))
    assert counted == [(1, 1), (0, 1), (0, 0)]  # pi_ref frozen and the PRM trained; the PRM alone (no pi_ref); neither
    # the policy's 16 bytes per parameter, pi_ref's 4 and the PRM's 16 (weights, gradients, AdamW's two moments)
    assert memory_needed_bytes(10**9, training=True, frozen_models=1, trained_models=1) == 36 * 10**9

# the gridworld toy's settings (conf/experiment/toy_learning/gigpo.yaml), small: some groups have a winner
TOY = ["experiment=smoke", "algorithm=oprl", "++model.tiny.initializer_range=0.3", "++model.tiny.vocab_size=512",
       "env.turn_tokens=2", "env.gridworld.moves=initials", "rollout.n=4", "trainer.prompts_per_step=2",
       "algorithm.online_prm.lr=1e-3", "logger=files"]


@pytest.mark.parametrize("baseline", ["reference", "policy"])
def test_a_run_trains_the_prm_and_resumes_exactly(tmp_path, monkeypatch, baseline):
    from test_resume import SMOKE, metrics_without_timing, run_and_resume_from_step_2

    built = []
    original = OnlinePRM.from_reference.__func__

    def recording(cls, settings, reference, *args, **kwargs):
        prm = original(cls, settings, reference, *args, **kwargs)
        built.append((prm, reference, {k: v.clone() for k, v in reference.state_dict().items()}))
        return prm

    monkeypatch.setattr(OnlinePRM, "from_reference", classmethod(recording))
    reference, resumed = run_and_resume_from_step_2([*SMOKE, *TOY, f"algorithm.online_prm.baseline={baseline}"], tmp_path)
    prm, start, initial = built[0]  # the uninterrupted run's: the PRM and the model it started from
    if baseline == "reference":  # the frozen reference; with baseline=policy it is the policy, which trains
        assert all(torch.equal(v, initial[k]) for k, v in start.state_dict().items())
    assert not all(torch.equal(v, initial[k]) for k, v in prm.model.state_dict().items())
    def repeatable(run):  # the memory peak and the episodes' seconds (multi_turn_episode_s) vary between runs
        return [{k: v for k, v in r.items() if k != "peak_memory_mb" and not k.endswith("_s")} for r in metrics_without_timing(run)]

    rows = repeatable(reference)
    assert sum(r["prm_pairs"] for r in rows) > 0 and all(math.isfinite(r["prm_loss"]) for r in rows if r["prm_pairs"])
    assert repeatable(resumed) == rows
    saved = [torch.load(run / "checkpoints" / "step_000004" / "state.pt", weights_only=True)["context"]["inputs"]["online_prm"]
             for run in (reference, resumed)]
    assert all(torch.equal(v, saved[1]["model"][k]) for k, v in saved[0]["model"].items())
