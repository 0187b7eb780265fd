"""PPO's critic: the value head's outputs, the value loss in the objective, the value targets, the
A2C = PPO equivalence, the separate critic model (algorithm.critic.model=separate), and the compositions
the validator refuses."""

import copy
from types import SimpleNamespace

import pytest
import torch

from conftest import algorithm_from
from rlbench.algorithm.critic import ValueHead, make_value_head, value_targets
from rlbench.errors import ConfigError
from rlbench.training.batch import collate
from rlbench.training.critic_model import SeparateCritic
from rlbench.training.forward import batch_outputs, token_outputs, value_model_outputs
from rlbench.training.update import micro_batch_loss, standard_update
from rlbench.training.update_schedules import make_update_state

from test_trainer import RecordingOptimizer, completions, tiny_lm


def critic_algorithm(loss="ppo_clip", clip=0.2, coef=0.5, critic_model="shared", critic_lr=None, **update):
    critic = {"coef": coef, "clip": clip, "model": critic_model, "lr": critic_lr}
    return algorithm_from({
        "name": "t", "advantage": {"name": "gae", "gamma": 1.0, "lam": 0.95}, "loss": {"name": loss},
        "aggregation": {"name": "token_mean"}, "critic": {k: v for k, v in critic.items() if v is not None},
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
    ({"update": {"schedule": "trpo"}, "critic": {"model": "separate"}}, r"schedule=trpo .* or a separate critic"),
    ({"advantage": {"name": "grpo"}, "critic": {"model": "separate"}}, r"does not use values.*separate critic model too"),
    ({"critic": {"lr": 1e-5}}, r"algorithm.critic.lr=1e-05 is the separate critic's learning rate.*model=separate"),
    ({"critic": {"model": "apart"}}, r"algorithm.critic.model must be one of shared, separate"),
    ({"critic": {"model": "separate", "lr": 0.0}}, r"algorithm.critic.lr must be > 0"),
])
def test_critic_compositions_that_cannot_run_are_refused_naming_the_conflict(changes, message):
    with pytest.raises(ConfigError, match=message):
        algorithm_from(_config(**changes))



# ------------------------------------------------------------------------------ separate critic model

ADAMW = SimpleNamespace(lr=1e-2, betas=[0.9, 0.999], weight_decay=0.0)  # the trainer's optimizer settings


def separate_critic(model, lr=1e-2, seed=0):
    """A separate critic of ``model`` whose head is random (a zero head has no gradient into its backbone)."""
    critic = SeparateCritic.from_policy(model, critic_algorithm(critic_model="separate").critic,
                                        SimpleNamespace(**{**vars(ADAMW), "lr": lr}))
    torch.manual_seed(seed)
    torch.nn.init.normal_(critic.model.head.linear.weight, std=0.5)
    return critic


def separate_batch(model, critic, algorithm, seed=0):
    """critic_batch with the separate critic's values."""
    batch = collate(completions(seed), pad_token_id=0)
    batch.rewards = torch.rand(batch.size, generator=torch.Generator().manual_seed(seed + 7))
    values = batch_outputs(model, batch, micro_batch_size=5, temperature=1.0, value_model=critic.model).values
    batch.old_values = values
    batch.advantages = algorithm.compute_advantages(batch.rewards, batch.group_index, batch.response_mask, values=values)
    batch.returns = value_targets(algorithm.advantage.params, batch.rewards, values, batch.response_mask)
    return batch


def test_separate_critic_is_a_copy_of_the_initial_policy_with_a_zero_head_and_reads_the_same_positions():
    model = tiny_lm().eval()
    state = make_update_state(critic_algorithm(critic_model="separate", critic_lr=5e-5), model, ADAMW)
    assert state.value_head is None and state.has_critic
    critic = state.critic
    assert critic.optimizer.param_groups[0]["lr"] == 5e-5  # critic.lr, not trainer.lr
    assert len(state.parameters(model)) == len(list(model.parameters()))  # the policy's optimizer: the policy only
    backbone = dict(critic.model.backbone.named_parameters())
    for name, p in model.named_parameters():  # the initial policy's weights, in tensors of its own
        assert torch.equal(backbone[name], p) and backbone[name].data_ptr() != p.data_ptr()
    batch = collate(completions(1), pad_token_id=0)
    assert torch.count_nonzero(value_model_outputs(critic.model, batch)) == 0  # V = 0 at the start
    # with one head, the separate critic's values are the shared head's on the (identical) initial backbone
    head = random_head(model)
    critic.model.head.load_state_dict(head.state_dict())
    shared = token_outputs(model, batch, value_head=head, share_prompts=False).values
    mask = batch.response_mask
    assert torch.allclose(value_model_outputs(critic.model, batch) * mask, shared * mask, atol=1e-5)


def gradients(parameters):
    return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in parameters]


def test_separate_critic_and_policy_take_no_gradient_from_each_others_loss():
    """One micro-batch objective L = L_policy + c_v L_value, backpropagated once (as standard_update does):
    with A = 0 (no policy gradient) the policy's parameters get none from the value loss, which the shared
    head's backbone does get; with R = V = V_old (no value gradient) the critic gets none from the policy loss."""
    algorithm = critic_algorithm(critic_model="separate", clip=None)
    model = tiny_lm()
    critic = separate_critic(model)
    batch = separate_batch(model, critic, algorithm)
    norms = {"batch_tokens": int(batch.response_mask.sum()), "batch_sequences": batch.size, "norm_length": 6}

    def backward(sub):
        model.zero_grad(set_to_none=True)
        critic.model.zero_grad(set_to_none=True)
        loss, metrics, _ = micro_batch_loss(model, sub, algorithm, norms, 1.0, value_model=critic.model)
        loss.backward()
        return metrics, gradients(model.parameters()), gradients(critic.parameters())

    no_advantage = copy.copy(batch)
    no_advantage.advantages = torch.zeros_like(batch.advantages)
    metrics, policy, value = backward(no_advantage)
    assert metrics["value_loss"] > 0 and all(torch.count_nonzero(g) == 0 for g in policy)
    assert sum(int(torch.count_nonzero(g)) for g in value) > 0
    exact_values = copy.copy(batch)
    exact_values.returns = batch.old_values  # V = V_old = R: the value loss is 0 and flat
    metrics, policy, value = backward(exact_values)
    assert metrics["value_loss"] == 0 and all(torch.count_nonzero(g) == 0 for g in value)
    assert sum(int(torch.count_nonzero(g)) for g in policy) > 0
    # the shared head on the same batch: the value loss does reach the backbone (the check above is not empty)
    shared = critic_algorithm(clip=None)
    head = random_head(model)
    model.zero_grad(set_to_none=True)
    micro_batch_loss(model, no_advantage, shared, norms, 1.0, value_head=head)[0].backward()
    assert sum(int(torch.count_nonzero(g)) for g in gradients(model.parameters())) > 0


def test_separate_critic_policy_update_equals_the_update_without_a_value_loss():
    """The policy's optimizer steps are those of the same loss without its value term (bit for bit)."""
    algorithm = critic_algorithm(critic_model="separate", epochs=2, minibatches=2)
    model = tiny_lm()
    critic = separate_critic(model)
    batch = separate_batch(model, critic, algorithm)
    batch.old_logp = batch_outputs(model, batch, micro_batch_size=5, temperature=1.0).logp
    no_critic = algorithm_from({"name": "t", "advantage": {"name": "grpo"}, "loss": {"name": "ppo_clip"},
                                "aggregation": {"name": "token_mean"}, "update": {"epochs": 2, "minibatches": 2}})
    results = []
    for algo_, with_critic in ((algorithm, critic), (no_critic, None)):
        m = copy.deepcopy(model)
        optimizer = torch.optim.AdamW(m.parameters(), lr=1e-2)
        stats = standard_update(m, optimizer, batch, algo_, micro_batch_size=4, max_grad_norm=1.0, temperature=1.0,
                                norm_length=6, generator=torch.Generator().manual_seed(3), critic=with_critic)
        results.append(torch.nn.utils.parameters_to_vector(m.parameters()))
        assert ("value_loss" in stats) == (with_critic is not None) and stats["optimizer_steps"] == 4
    assert torch.equal(results[0], results[1])


def test_separate_critic_step_is_the_hand_computed_adamw_step_on_the_clipped_value_loss():
    """One update (1 epoch, 1 mini-batch, no clipping of the gradient norm) on a hand-made batch. The zero head
    gives V = V_old = 0, so the clipped value loss is 0.5 * token_mean(R^2) (both branches equal); its gradient is
    c_v * token_mean((V - R) dV): in the head's bias -c_v token_mean(R), in its weight -c_v token_mean(R h_t)
    (h_t: the initial policy's final hidden state before token t), in the backbone 0 (w = 0). AdamW's first step
    (m = (1 - b1) g, v = (1 - b2) g^2, bias-corrected) moves each parameter by -lr g / (|g| + eps)."""
    coef, lr, eps = 0.5, 1e-3, 1e-8
    algorithm = critic_algorithm(critic_model="separate", coef=coef, clip=0.2)
    model = tiny_lm()
    critic = SeparateCritic.from_policy(model, algorithm.critic, SimpleNamespace(**{**vars(ADAMW), "lr": lr}))
    batch = collate(completions(0), pad_token_id=0)
    mask, T = batch.response_mask, batch.response_mask.shape[1]
    batch.rewards = torch.ones(batch.size)
    batch.old_values = torch.zeros_like(mask)
    batch.advantages = torch.zeros_like(mask)
    batch.returns = torch.linspace(0.1, 1.0, mask.numel()).reshape(mask.shape) * mask  # R > 0 on every token
    tokens = mask.sum()
    expected_loss = 0.5 * float((batch.returns ** 2).sum() / tokens)
    with torch.no_grad():  # h_t from the policy (the critic's initial weights), left padding skipped by position ids
        positions = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
        hidden = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=positions,
                       output_hidden_states=True).hidden_states[-1][:, -(T + 1):-1]
    g_bias = -coef * batch.returns.sum() / tokens
    g_weight = -coef * (batch.returns[..., None] * hidden).sum((0, 1)) / tokens
    before = [p.detach().clone() for p in critic.parameters()]
    stats = standard_update(model, torch.optim.SGD(model.parameters(), lr=0.0), batch, algorithm, micro_batch_size=5,
                            max_grad_norm=None, temperature=1.0, norm_length=6, critic=critic)
    assert stats["value_loss"] == pytest.approx(expected_loss, rel=1e-6)
    assert stats["critic_grad_norm"] == pytest.approx(float(torch.cat([g_weight, g_bias[None]]).norm()), rel=1e-5)
    head = critic.model.head.linear
    assert torch.allclose(head.bias, -lr * g_bias / (g_bias.abs() + eps), rtol=1e-5, atol=0)
    assert torch.allclose(head.weight[0], -lr * g_weight / (g_weight.abs() + eps), rtol=1e-4, atol=1e-9)
    backbone = len(list(critic.model.backbone.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(before[:backbone], critic.parameters()[:backbone]))  # no gradient yet
    # further updates on the batch lower the value loss (the head learns, then the backbone follows)
    for _ in range(30):
        stats = standard_update(model, torch.optim.SGD(model.parameters(), lr=0.0), batch, algorithm, micro_batch_size=5,
                                max_grad_norm=None, temperature=1.0, norm_length=6, critic=critic)
    assert stats["value_loss"] < 0.6 * expected_loss  # (the value clip at V_old +- 0.2 bounds how far it falls)


def test_separate_critic_state_round_trips_weights_and_optimizer_moments():
    algorithm = critic_algorithm(critic_model="separate", critic_lr=1e-2)
    model = tiny_lm()
    state = make_update_state(algorithm, model, ADAMW)
    batch = separate_batch(model, state.critic, algorithm)
    standard_update(model, torch.optim.SGD(model.parameters(), lr=0.0), batch, algorithm, micro_batch_size=5,
                    max_grad_norm=1.0, temperature=1.0, norm_length=6, critic=state.critic)
    saved = copy.deepcopy(state.state_dict())
    assert set(saved) == {"critic"}
    restored = make_update_state(algorithm, tiny_lm(), ADAMW)
    restored.load_state_dict(saved)
    for critic in (state.critic, restored.critic):  # one more step each: the same weights after it
        standard_update(model, torch.optim.SGD(model.parameters(), lr=0.0), batch, algorithm, micro_batch_size=5,
                        max_grad_norm=1.0, temperature=1.0, norm_length=6, critic=critic)
    assert torch.equal(torch.nn.utils.parameters_to_vector(state.critic.parameters()),
                       torch.nn.utils.parameters_to_vector(restored.critic.parameters()))
    assert set(make_update_state(critic_algorithm(), model).state_dict()) == {"value_head"}  # shared: as before


def test_separate_critic_of_a_lora_policy_trains_its_own_adapter_and_head():
    from test_lora import lora_model

    model = lora_model()
    critic = separate_critic(model)
    trained = [n for n, p in critic.model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n or n.startswith("head.") for n in trained)
    policy = {id(p) for p in model.parameters()}
    assert not any(id(p) in policy for p in critic.model.parameters())  # its own copy, base weights included
    algorithm = critic_algorithm(critic_model="separate", clip=None)
    batch = separate_batch(model, critic, algorithm)
    batch.advantages = torch.zeros_like(batch.advantages)
    norms = {"batch_tokens": int(batch.response_mask.sum()), "batch_sequences": batch.size, "norm_length": 6}
    micro_batch_loss(model, batch, algorithm, norms, 1.0, value_model=critic.model)[0].backward()
    assert all(p.grad is None or torch.count_nonzero(p.grad) == 0 for p in model.parameters())
    assert any(p.grad is not None and torch.count_nonzero(p.grad) > 0 for n, p in critic.model.named_parameters()
               if "lora_" in n)
