"""ReMix (algorithm=remix, arXiv:2507.06892): whole past groups replayed from a window of recent policies
with their stored behaviour log-probs, the KL-Convex constraint (algorithm.kl.previous_weight), the
update-to-data ratio (update.epochs x minibatches optimizer steps per generated batch) and the policy
reincarnation (algorithm.reincarnate_at)."""

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from rlbench.config.typed import rollout_config
from conftest import algorithm_from
from rlbench.validation import validate_config
from rlbench.errors import ConfigError
from rlbench.rollout import validate_strategy
from rlbench.rollout.guided.replay import ReplayBuffer
from rlbench.training.batch import collate
from rlbench.training.step import behaviour_old_logp, reincarnate, stamp_policy_version

from conftest import smoke_cli_steps
from test_replay import problem, response, run_steps, strategy_for


# ------------------------------------------------------------------------- the convex KL, closed form


def k3(logp, ref):
    return math.exp(ref - logp) - (ref - logp) - 1


def convex_kl_algorithm(previous_weight, coef=0.5):
    return algorithm_from(OmegaConf.create({
        "advantage": {"name": "grpo"}, "loss": {"name": "ppo_clip"}, "aggregation": {"name": "token_mean"},
        "kl": {"coef": coef, "estimator": "k3", "previous_weight": previous_weight},
    }))


@pytest.mark.parametrize("w", [0.0, 0.25, 1.0])
def test_convex_kl_is_the_weighted_sum_of_the_kl_to_the_base_and_to_the_previous_policy(w):
    logp = torch.tensor([[-0.5, -1.0, -2.0]])
    ref = torch.tensor([[-0.7, -0.4, -2.5]])
    prev = torch.tensor([[-0.6, -1.3, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the last token is padding
    algorithm = convex_kl_algorithm(w)
    zeros = torch.zeros_like(logp)
    loss, metrics = algorithm.compute_loss(
        logp=logp, old_logp=logp, advantages=zeros, response_mask=mask,
        norms={"batch_tokens": 2, "batch_sequences": 1, "norm_length": 3}, ref_logp=ref, prev_logp=prev,
    )
    expected = [(1 - w) * k3(a, b) + w * k3(a, c) for a, b, c in zip([-0.5, -1.0], [-0.7, -0.4], [-0.6, -1.3])]
    assert metrics["kl"] == pytest.approx(sum(expected) / 2, rel=1e-6)  # token mean over the 2 response tokens
    assert loss.item() == pytest.approx(0.5 * sum(expected) / 2, rel=1e-6)  # zero advantages: beta x KL only
    if w == 0:  # lambda = 1: the base-only KL, no previous policy needed
        _, base_only = algorithm.compute_loss(
            logp=logp, old_logp=logp, advantages=zeros, response_mask=mask,
            norms={"batch_tokens": 2, "batch_sequences": 1, "norm_length": 3}, ref_logp=ref,
        )
        assert base_only["kl"] == pytest.approx(metrics["kl"])


def test_convex_kl_needs_the_previous_policy_and_a_loss_kl():
    with pytest.raises(ValueError, match="prev_logp"):
        convex_kl_algorithm(0.5).loss_kl_matrix(torch.zeros(1, 2), torch.zeros(1, 2), None)
    with pytest.raises(ConfigError, match="needs algorithm.kl.coef > 0"):
        convex_kl_algorithm(0.5, coef=0.0)
    with pytest.raises(ConfigError, match=r"previous_weight must be in \[0, 1\]"):
        convex_kl_algorithm(1.5)
    assert convex_kl_algorithm(0.5).needs_sampling_pass  # pi_prev comes from the sampling pass


# ------------------------------------------------------------------------------ the off-policy window


def test_window_keeps_only_the_responses_of_the_last_policies():
    buffer = ReplayBuffer(capacity=100, seed=0, keep="all", window=2)
    for version in range(4):
        buffer.observe(problem(str(version)), [response([2], version=version), response([1], version=version)],
                       [True, False])
    # every response is kept (correct or not), and only versions 2 and 3 (the newest 2) remain
    assert sorted({item.policy_version for item in buffer.items}) == [2, 3] and len(buffer) == 4
    assert list(buffer.problems) == ["2", "3"]


REMIX_ROLLOUT = {"strategy": "replay", "replay": {"keep": "all", "questions": "buffer", "buffer_share": 0.5,
                                                   "per_group": 2, "replace_fresh": True, "window": 1}}


def test_remix_batches_mix_fresh_groups_with_whole_past_groups_at_their_behaviour_ratio():
    # question 0 answers [2, 4] (correct), 1 answers [1, 3] (wrong): both are kept as whole groups
    script = {0: [2, 4], 1: [1, 3], 2: [2, 3], 3: [4, 4]}
    strategy, engine = strategy_for(script, REMIX_ROLLOUT, n=2)
    run_steps(strategy, ["0", "1"], 1)  # version 0 fills the buffer
    graded, metrics = strategy.rollout([problem("2"), problem("3")])
    assert graded.problems[0].uid == "2" and graded.problems[1].uid in {"0", "1"}
    assert [count for _, count in engine.calls[-1]] == [2, 0]  # the past group replaces a fresh prompt: nothing generated
    past = graded.groups[1]
    assert [c.behaviour for c in past] == ["replay", "replay"] and [c.policy_version for c in past] == [0, 0]
    assert graded.groups[0][0].behaviour == "policy" and metrics["replay_responses"] == 2
    batch = collate(graded.groups, 0, current_version=1)
    old = behaviour_old_logp(batch, torch.full(batch.response_mask.shape, -9.0))
    assert torch.all(old[2:, :2] == -0.25) and torch.all(old[:2, :2] == -9.0)  # stored mu, never a silent 1


def test_a_fresh_prompt_of_the_window_is_sampled_fresh_and_stop_replay_goes_on_policy():
    strategy, engine = strategy_for({0: [2, 4], 1: [1, 3]}, REMIX_ROLLOUT, n=2)
    run_steps(strategy, ["0"], 1)
    graded, _ = strategy.rollout([problem("0"), problem("1")])  # 0 is held: still a fresh prompt of this step
    stamp_policy_version(graded, 1)
    assert [p.uid for p in graded.problems] == ["0", "1"] and engine.calls[-1] == [(0, 2), (1, 2)]
    strategy.stop_replay()
    stamp = run_steps(strategy, ["1", "0"], 2)
    assert all(m["replay_responses"] == 0 for _, m in stamp)
    assert all(c.behaviour == "policy" for graded, _ in stamp for g in graded.groups for c in g)
    restored, _ = strategy_for({0: [2, 4], 1: [1, 3]}, REMIX_ROLLOUT, n=2)
    restored.load_state_dict(strategy.state_dict())
    assert restored.stopped


@pytest.mark.parametrize("block, message", [
    ({"keep": "all", "questions": "same"}, "needs questions=buffer"),
    ({"keep": "some"}, "keep='some'"),
    ({"window": 0}, "window must be >= 1"),
    ({"keep": "all", "questions": "buffer", "per_group": 3, "replace_fresh": True}, "per_group must be < rollout.n"),
])
def test_bad_remix_replay_options_are_refused(block, message):
    with pytest.raises(ConfigError, match=message):
        validate_strategy(rollout_config({"strategy": "replay", "n": 2, "replay": block}), "grpo")


# --------------------------------------------------------------------------------------- reincarnation


def test_reincarnation_makes_the_policy_the_reference_and_stops_replay():
    policy = torch.nn.Linear(3, 2)
    reference = copy.deepcopy(policy).requires_grad_(False)
    with torch.no_grad():
        policy.weight.add_(1.0)
    stopped = []
    ctx = SimpleNamespace(model=policy, reference=reference, strategy=SimpleNamespace(stop_replay=lambda: stopped.append(1)))
    reincarnate(ctx)
    assert torch.equal(reference.weight, policy.weight) and stopped == [1]
    assert reference.weight.data_ptr() != policy.weight.data_ptr()  # a copy, not the policy itself


def test_reincarnation_is_refused_with_the_asynchronous_pipeline(make_cfg):
    cfg = make_cfg("experiment=smoke", "algorithm=remix", "trainer.max_staleness=1", "algorithm.reincarnate_at=3")
    with pytest.raises(ConfigError, match="reincarnate_at"):
        validate_config(cfg)


# ------------------------------------------------------------------------------ the preset, end to end


@pytest.mark.slow
def test_remix_runs_from_the_cli_with_its_utd_ratio_and_switches_to_on_policy(tmp_path):
    steps = smoke_cli_steps(tmp_path / "run", "algorithm=remix", "trainer.steps=4", "algorithm.reincarnate_at=3",
                            "eval.before_training=false")
    assert [s["optimizer_steps"] for s in steps] == [2.0] * 4  # UTD 2: two updates per generated batch
    assert steps[1]["off_policy_token_fraction"] > 0 and steps[1]["replay_responses"] > 0  # step 2 replays step 1
    assert steps[1]["generated_responses"] < steps[0]["generated_responses"]  # a past group costs no generation
    assert all("off_policy_token_fraction" not in s and s["replay_responses"] == 0 for s in steps[2:])  # from step 3
    assert all(s["kl"] >= 0 for s in steps)
