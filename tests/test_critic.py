"""PPO's critic: the value head's outputs, the value loss in the objective, the value targets, the
A2C = PPO equivalence, and the compositions the validator refuses."""

import copy

import pytest
import torch

from conftest import algorithm_from
from rlbench.algorithm.critic import ValueHead, make_value_head, value_targets
from rlbench.errors import ConfigError
from rlbench.training.batch import collate
from rlbench.training.forward import batch_outputs, token_outputs
from rlbench.training.update import standard_update
from rlbench.training.update_schedules import make_update_state

from test_trainer import RecordingOptimizer, completions, tiny_lm


def critic_algorithm(loss="ppo_clip", clip=0.2, coef=0.5, **update):
    return algorithm_from({
        "name": "t", "advantage": {"name": "gae", "gamma": 1.0, "lam": 0.95}, "loss": {"name": loss},
        "aggregation": {"name": "token_mean"}, "critic": {"coef": coef, "clip": clip},
        "update": update or {"epochs": 1, "minibatches": 1},
    })


def random_head(model, seed=0):
    torch.manual_seed(seed)
    head = make_value_head(model)
    torch.nn.init.normal_(head.linear.weight, std=0.5)
    torch.nn.init.normal_(head.linear.bias, std=0.5)
    return head


def critic_batch(model, head, algorithm, seed=0):
    """A batch as the runner prepares it: V_old from a no-grad pass, GAE advantages, lambda-returns."""
    batch = collate(completions(seed), pad_token_id=0)
    batch.rewards = torch.rand(batch.size, generator=torch.Generator().manual_seed(seed + 7))
    before = batch_outputs(model, batch, micro_batch_size=5, temperature=1.0, value_head=head)
    batch.old_values = before.values
    batch.advantages = algorithm.compute_advantages(
        batch.rewards, batch.group_index, batch.response_mask, values=before.values
    )
    batch.returns = value_targets(algorithm.advantage.params, batch.rewards, before.values, batch.response_mask)
    return batch


# ------------------------------------------------------------------------------------------- value head


def test_value_head_starts_at_zero_and_has_hidden_size_inputs():
    model = tiny_lm()
    head = make_value_head(model)
    assert head.linear.in_features == model.config.hidden_size
    out = token_outputs(model, collate(completions(1), pad_token_id=0), value_head=head)
    assert out.values.shape == out.logp.shape
    assert torch.count_nonzero(out.values) == 0


def test_values_read_the_hidden_state_that_predicts_each_response_token():
    model = tiny_lm().eval()
    head = random_head(model)
    batch = collate(completions(1), pad_token_id=0)
    values = token_outputs(model, batch, value_head=head, share_prompts=False).values
    row = int((batch.response_mask.sum(-1) > 1).nonzero()[0])
    ids = batch.input_ids[row][batch.attention_mask[row].bool()]
    r = int(batch.response_mask[row].sum())
    with torch.no_grad():  # unpadded forward: the state before response token t is position len - r - 1 + t
        hidden = model(ids[None], output_hidden_states=True).hidden_states[-1][0]
        expected = head(hidden[-r - 1 : -1])
    assert torch.allclose(values[row, :r], expected, atol=1e-5)


def test_values_agree_between_shared_prompt_and_per_row_forwards_and_are_zero_on_padding():
    model = tiny_lm().eval()
    head = random_head(model)
    batch = collate(completions(2, groups=3, n=4), pad_token_id=0)
    per_row = token_outputs(model, batch, value_head=head, share_prompts=False).values
    shared = token_outputs(model, batch, value_head=head, share_prompts=True).values
    mask = batch.response_mask
    assert torch.allclose(per_row * mask, shared * mask, atol=1e-5)
    stored = batch_outputs(model, batch, micro_batch_size=5, temperature=1.0, value_head=head).values
    assert torch.allclose(stored, per_row * mask, atol=1e-5)
    assert torch.all(stored[mask == 0] == 0) and torch.count_nonzero(stored[mask > 0]) > 0


# ----------------------------------------------------------------------------------- targets and loss


def test_value_targets_are_the_gae_lambda_returns_of_the_estimators_gamma_and_lam():
    # gamma = lam = .5, V = [.2, .5, .9], R = 1 on the last token -> returns [.24375, .475, 1.0]
    values, mask = torch.tensor([[0.2, 0.5, 0.9]]), torch.ones(1, 3)
    params = {"gamma": 0.5, "lam": 0.5, "whiten": True, "epsilon": 1e-8}  # whitening is not for targets
    targets = value_targets(params, torch.tensor([1.0]), values, mask)
    assert torch.allclose(targets, torch.tensor([[0.24375, 0.475, 1.0]]))
    # gamma = lam = 1: every token's target is the outcome reward
    assert torch.allclose(value_targets({"gamma": 1.0, "lam": 1.0}, torch.tensor([1.0]), values, mask), torch.ones(1, 3))


def test_value_loss_enters_the_objective_with_its_coefficient():
    # token_mean over 3 valid tokens; ratio 1 and A = 0, so the policy term is 0.
    # V = [1, .9, .3], V_old = [.5, .5, .3], R = [0, 1, 1], clip .2:
    #   t0: max(.5*1, .5*(.7)^2) = .5;  t1: max(.5*.01, .5*(.3)^2) = .045;  t2: .5*(.7)^2 = .245
    algorithm = critic_algorithm(coef=0.5, clip=0.2)
    values = torch.tensor([[1.0, 0.9, 0.3, 7.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    logp = torch.zeros(1, 4, requires_grad=True)
    loss, metrics = algorithm.compute_loss(
        logp=logp, old_logp=logp.detach(), advantages=torch.zeros(1, 4), response_mask=mask,
        norms={"batch_tokens": 3, "batch_sequences": 1, "norm_length": 4},
        values=values, old_values=torch.tensor([[0.5, 0.5, 0.3, 0.0]]), returns=torch.tensor([[0.0, 1.0, 1.0, 0.0]]),
    )
    expected_value_loss = (0.5 + 0.045 + 0.245) / 3
    assert metrics["value_loss"] == pytest.approx(expected_value_loss)
    assert loss.item() == pytest.approx(0.5 * expected_value_loss)
    loss.backward()
    # d/dV: coef/N * (V - R) on unclipped branches (t0, t2); t1's clipped branch is flat in V; padding 0
    assert torch.allclose(values.grad, torch.tensor([[0.5 / 3 * 1.0, 0.0, 0.5 / 3 * -0.7, 0.0]]))


def test_policy_update_trains_the_value_head_toward_the_returns():
    algorithm = critic_algorithm(clip=None, coef=1.0)
    model = tiny_lm()
    head = random_head(model)
    batch = critic_batch(model, head, algorithm)
    before = torch.nn.functional.mse_loss(batch.old_values[batch.response_mask > 0], batch.returns[batch.response_mask > 0])
    optimizer = torch.optim.SGD([*model.parameters(), *head.parameters()], lr=0.05)
    for _ in range(5):
        stats = standard_update(model, optimizer, batch, algorithm, micro_batch_size=4, max_grad_norm=None,
                                temperature=1.0, norm_length=6, value_head=head)
    after_values = batch_outputs(model, batch, micro_batch_size=5, temperature=1.0, value_head=head).values
    after = torch.nn.functional.mse_loss(after_values[batch.response_mask > 0], batch.returns[batch.response_mask > 0])
    assert stats["value_loss"] > 0 and after < before


# ------------------------------------------------------------------------------ A2C = PPO (1 x 1 update)


def first_update_gradient(base_model, base_head, batch, algorithm):
    """The gradient of the first optimizer step of ``algorithm`` on ``batch`` (copies of the model and
    head), one tensor per parameter, the head's last; the update is checked to take one step."""
    model, head = copy.deepcopy(base_model), copy.deepcopy(base_head)
    recorder = RecordingOptimizer([*model.parameters(), *head.parameters()])
    stats = standard_update(model, recorder, batch, algorithm, micro_batch_size=5, max_grad_norm=None,
                            temperature=1.0, norm_length=6, value_head=head)
    assert stats["optimizer_steps"] == 1 and stats["value_loss"] > 0
    return recorder.steps[0]


def test_a2c_equals_ppo_with_one_epoch_and_one_full_batch():
    """A2C (REINFORCE loss -A logp, unclipped value loss) and PPO (clipped ratio, clipped value loss)
    with one epoch over one full mini-batch give the same gradient: at the first step rho = 1 and
    V = V_old, so neither clip is active (PPO, arXiv:1707.06347, section 5, eq. 9)."""
    a2c = critic_algorithm(loss="reinforce", clip=None)
    ppo = critic_algorithm(loss="ppo_clip", clip=0.2, epochs=1, minibatches=1)
    base_model = tiny_lm()
    base_head = random_head(base_model)
    batch = critic_batch(base_model, base_head, ppo)
    assert torch.count_nonzero(batch.advantages) > 0 and torch.count_nonzero(batch.returns - batch.old_values) > 0
    grads = [first_update_gradient(base_model, base_head, batch, algorithm) for algorithm in (a2c, ppo)]
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)
    head_grads = grads[0][-2:]
    backbone_grads = grads[0][:-2]
    assert all(g.abs().sum() > 0 for g in head_grads) and any(g.abs().sum() > 0 for g in backbone_grads)


def test_ppo_ratio_loss_differs_from_a2c_once_the_batch_is_reused():
    """The equivalence is specific to one on-policy step: a second epoch moves rho off 1 and V off
    V_old, where PPO's clips and A2C's plain terms part ways (the test above cannot pass trivially)."""
    model = tiny_lm()
    head = random_head(model)
    batch = critic_batch(model, head, critic_algorithm())
    batch.old_logp = batch_outputs(model, batch, micro_batch_size=5, temperature=1.0).logp
    results = []
    for loss, clip in (("reinforce", None), ("ppo_clip", 0.2)):
        algorithm = critic_algorithm(loss=loss, clip=clip, epochs=2, minibatches=1)
        m, h = copy.deepcopy(model), copy.deepcopy(head)
        optimizer = torch.optim.SGD([*m.parameters(), *h.parameters()], lr=2.0)
        standard_update(m, optimizer, batch, algorithm, micro_batch_size=5, max_grad_norm=None,
                        temperature=1.0, norm_length=6, value_head=h)
        results.append(torch.nn.utils.parameters_to_vector([*m.parameters(), *h.parameters()]))
    assert not torch.allclose(results[0], results[1], atol=1e-6)


# ------------------------------------------------------------------------------------- composition


def test_update_state_keeps_a_value_head_only_with_a_critic():
    model = tiny_lm()
    state = make_update_state(critic_algorithm(), model)
    assert isinstance(state.value_head, ValueHead)
    assert len(state.parameters(model)) == len(list(model.parameters())) + 2
    grpo = algorithm_from({"name": "g", "advantage": {"name": "grpo"}, "loss": {"name": "ppo_clip"},
                                  "aggregation": {"name": "token_mean"}})
    assert make_update_state(grpo, model).value_head is None


def _config(**changes):
    cfg = {"name": "t", "advantage": {"name": "gae"}, "loss": {"name": "ppo_clip"},
           "aggregation": {"name": "token_mean"}, "critic": {"coef": 0.5, "clip": 0.2}}
    cfg.update(changes)
    return {k: v for k, v in cfg.items() if v is not None}


@pytest.mark.parametrize("changes,message", [
    ({"critic": None}, r"advantage 'gae' needs critic values.*no value head"),
    ({"advantage": {"name": "grpo"}}, r"algorithm.critic adds a value head, but advantage 'grpo' does not use values"),
    ({"critic": {"coef": 0.0}}, r"algorithm.critic.coef must be > 0"),
    ({"critic": {"coef": 0.5, "clip": -1.0}}, r"algorithm.critic.clip must be > 0 or null"),
    ({"critic": {"coef": 0.5, "vf_coef": 1.0}}, r"algorithm.critic has no key\(s\) \['vf_coef'\]"),
    ({"update": {"schedule": "trpo"}}, r"schedule=trpo .* no gradient steps for a value head"),
])
def test_critic_compositions_that_cannot_run_are_refused_naming_the_conflict(changes, message):
    with pytest.raises(ConfigError, match=message):
        algorithm_from(_config(**changes))

