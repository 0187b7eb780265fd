"""The update step: batch layout, log-probs, exact gradient accumulation, and steps without a trainable token."""

import logging
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import algorithm_from
from rlbench.rollout.engines.base import Completion
from rlbench.training.batch import collate, mask_truncated, trainable_tokens
from rlbench.training.forward import batch_outputs, groups_share_prompts, token_outputs
from rlbench.training.loop import UntrainedSteps
from rlbench.training.update import UpdateMetrics, standard_update


def tiny_lm(seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    return LlamaForCausalLM(config).float()


def completions(seed=0, groups=3, n=4):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(groups):
        prompt = tuple(torch.randint(3, 32, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist())
        group = []
        for _ in range(n):
            length = int(torch.randint(0, 7, (1,), generator=g))  # includes zero-length responses
            resp = torch.randint(3, 32, (length,), generator=g).tolist()
            group.append(Completion(i, prompt, resp, [0.0] * length, finished=True))
        out.append(group)
    return out


class RecordingOptimizer:
    """Stands in for an optimizer: records the accumulated gradient at each step (of a model's
    parameters, or of the given parameters)."""

    def __init__(self, model):
        self.params = list(model.parameters() if isinstance(model, torch.nn.Module) else model)
        self.steps = []

    def step(self):
        self.steps.append([p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in self.params])

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


def algo(aggregation, advantage="grpo", **update):
    return algorithm_from({
        "name": "t", "advantage": {"name": advantage}, "loss": {"name": "ppo_clip"},
        "aggregation": {"name": aggregation}, "update": update or {"epochs": 1, "minibatches": 1},
    })


def prepared_batch(algorithm, seed=0):
    batch = collate(completions(seed), pad_token_id=0)
    batch.rewards = torch.rand(batch.size, generator=torch.Generator().manual_seed(seed + 7))
    batch.advantages = algorithm.compute_advantages(batch.rewards, batch.group_index, batch.response_mask)
    return batch


def test_collate_layout():
    groups = [[Completion(0, (5, 6, 7), [8, 9], [0, 0], True), Completion(0, (5, 6, 7), [], [], False)],
              [Completion(1, (4,), [10, 11, 12], [0, 0, 0], True)]]
    b = collate(groups, pad_token_id=0)
    assert b.prompt_width == 3
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9, 0], [5, 6, 7, 0, 0, 0], [0, 0, 4, 10, 11, 12]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1]]
    assert b.response_mask.tolist() == [[1, 1, 0], [0, 0, 0], [1, 1, 1]]
    assert b.group_index.tolist() == [0, 0, 1]


def test_token_outputs_match_unpadded_forward():
    model = tiny_lm().eval()
    batch = collate(completions(1), pad_token_id=0)
    out = token_outputs(model, batch, temperature=0.7, with_entropy=True)
    logp, entropy = out.logp, out.entropy
    row = 0
    while batch.response_mask[row].sum() == 0:
        row += 1
    ids = batch.input_ids[row][batch.attention_mask[row].bool()]
    r = int(batch.response_mask[row].sum())
    with torch.no_grad():
        logits = model(ids[None]).logits[0].float() / 0.7
    ref = torch.log_softmax(logits[-r - 1 : -1], -1).gather(-1, ids[-r:, None])[:, 0]
    assert torch.allclose(logp[row, :r], ref, atol=1e-5)
    assert torch.all(entropy[row, :r] > 0)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"])
def test_micro_batch_accumulation_equals_full_batch_gradient(aggregation):
    algorithm = algo(aggregation)
    grads = []
    for micro in (12, 5, 1):
        model = tiny_lm()
        batch = prepared_batch(algorithm)
        opt = RecordingOptimizer(model)
        standard_update(model, opt, batch, algorithm, micro_batch_size=micro, max_grad_norm=None,
                        temperature=1.0, norm_length=6)
        grads.append(opt.steps[0])
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    assert any(g.abs().sum() > 0 for g in grads[0])


def test_minibatches_and_epochs_make_that_many_steps_with_stored_old_logp():
    algorithm = algo("token_mean", epochs=2, minibatches=3)
    model = tiny_lm()
    batch = prepared_batch(algorithm)
    batch.old_logp = batch_outputs(model, batch, micro_batch_size=4, temperature=1.0).logp
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    stats = standard_update(model, opt, batch, algorithm, micro_batch_size=2, max_grad_norm=1.0,
                            temperature=1.0, norm_length=6, generator=torch.Generator().manual_seed(0))
    assert stats["optimizer_steps"] == 6
    assert stats["ratio_mean"] != pytest.approx(1.0, abs=1e-9)  # later steps are off-policy


def test_each_minibatch_is_normalised_by_its_own_token_count():
    """minibatches=2, token_mean, one on-policy epoch (ratio 1): the first optimizer step's gradient is
    the closed form -sum_{t in M} A_t grad log pi(t) / |M|, where |M| counts the first mini-batch's
    response tokens, not the whole batch's (which would shrink the gradient by about half)."""
    algorithm = algo("token_mean", epochs=1, minibatches=2)
    model = tiny_lm()
    batch = prepared_batch(algorithm)
    opt = RecordingOptimizer(model)
    standard_update(model, opt, batch, algorithm, micro_batch_size=2, max_grad_norm=None, temperature=1.0,
                    norm_length=6, generator=torch.Generator().manual_seed(0))
    first = torch.randperm(batch.size, generator=torch.Generator().manual_seed(0)).chunk(2)[0]
    sub = batch.select(first)
    mask = sub.response_mask.float()
    assert 0 < mask.sum() < batch.response_mask.sum()  # the two counts differ
    advantages = sub.advantages if sub.advantages.dim() == 2 else sub.advantages[:, None]
    reference = tiny_lm()
    logp = token_outputs(reference, sub, temperature=1.0).logp
    (-(advantages * logp * mask).sum() / mask.sum()).backward()
    for got, want in zip(opt.steps[0], (p.grad for p in reference.parameters())):
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-4)
    assert sum(float(g.abs().sum()) for g in opt.steps[0]) > 0


def test_one_update_needs_no_old_logprob_pass_and_has_ratio_one():
    algorithm = algo("seq_mean_token_mean")
    assert not algorithm.needs_old_logp
    model = tiny_lm()
    stats = standard_update(model, RecordingOptimizer(model), prepared_batch(algorithm), algorithm,
                            micro_batch_size=4, max_grad_norm=1.0, temperature=1.0, norm_length=6)
    assert stats["ratio_mean"] == pytest.approx(1.0)
    assert stats["clip_fraction"] == 0.0


def test_shared_prompt_forward_gives_the_same_logprobs_and_gradients():
    batch = collate(completions(3, groups=3, n=4), pad_token_id=0)
    batch.select(torch.arange(batch.size))  # select keeps the layout
    assert_packed_equals_per_row(batch, model_seed=2, temperature=0.8)


def assert_packed_equals_per_row(batch, model_seed: int, temperature: float) -> None:
    """Log-probs and the gradients of (log-probs + entropies) agree between the per-row and the packed forward."""
    results = []
    for share in (False, True):
        model = tiny_lm(seed=model_seed)
        out = token_outputs(model, batch, temperature=temperature, with_entropy=True, share_prompts=share)
        ((out.logp * batch.response_mask).sum() + (out.entropy * batch.response_mask).sum()).backward()
        results.append((out.logp * batch.response_mask, [p.grad.clone() for p in model.parameters()]))
    (logp_a, grads_a), (logp_b, grads_b) = results
    assert torch.allclose(logp_a, logp_b, atol=1e-5)
    for a, b in zip(grads_a, grads_b):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def test_shared_prompt_forward_with_scattered_group_rows():
    batch = collate(completions(4, groups=3, n=3), pad_token_id=0)
    rows = torch.tensor([7, 0, 4, 8, 1])  # groups 2, 0, 1, 2, 0 in mixed order
    sub = batch.select(rows)
    model = tiny_lm(seed=5).eval()
    a = token_outputs(model, sub, share_prompts=False).logp
    b = token_outputs(model, sub, share_prompts=True).logp
    assert torch.allclose(a * sub.response_mask, b * sub.response_mask, atol=1e-5)


def test_pack_groups_lays_out_each_prompt_once_and_every_response_without_padding():
    """Closed form on two groups: prompt 11 12 13 (row 0, 1) and 21 22 left-padded (row 2); responses
    of 2, 1 and 3 tokens, right-padded to 3."""
    from rlbench.training.packing import pack_groups

    ids = torch.tensor([[11, 12, 13, 1, 2, 0], [11, 12, 13, 3, 0, 0], [0, 21, 22, 4, 5, 6]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1]])
    layout = pack_groups(ids, mask, 3, 3, row_to_group=torch.tensor([0, 0, 1]), first_row=torch.tensor([0, 2]))
    # prompts without their last token, then each row: last prompt token + response but its last token
    assert layout.input_ids.tolist() == [[11, 12, 21, 13, 1, 13, 22, 4, 5]]
    assert layout.position_ids.tolist() == [[0, 1, 0, 2, 3, 2, 1, 2, 3]]
    assert layout.prompt_tokens == 3 and layout.prompts == [(0, 2), (2, 3)]
    assert layout.index.tolist() == [[0, 1, -1], [2, -1, -1], [3, 4, 5]]
    (a, b) = layout.blocks  # one block per group here
    assert (a.start, a.end, a.prompt, b.start, b.end, b.prompt) == (3, 6, (0, 2), 6, 9, (2, 3))
    assert a.mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 1]]  # prompt | own segment, causal
    assert b.mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    split = pack_groups(ids, mask, 3, 3, torch.tensor([0, 0, 1]), torch.tensor([0, 2]), block_tokens=2)
    assert [(x.start, x.end) for x in split.blocks] == [(3, 5), (5, 6), (6, 9)]  # a row longer than a block: alone


def test_packed_forward_gives_the_per_row_logprobs_entropies_values_and_gradients(monkeypatch):
    """The packed forward (response blocks of at most 8 tokens: several per group) gives the per-row
    forward's log-probs, entropies, critic values and gradients on every response token, and zeros past
    a row's end."""
    import rlbench.training.forward as forward
    import rlbench.training.packing as packing

    monkeypatch.setattr(packing, "BLOCK_TOKENS", 8)
    seen = []
    real = forward.pack_groups
    monkeypatch.setattr(forward, "pack_groups", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    batch = collate(completions(8, groups=3, n=4), pad_token_id=0)
    results = []
    for share in (False, True):
        model = tiny_lm(seed=4)
        torch.manual_seed(1)
        value_head = torch.nn.Linear(16, 1)  # a critic on the final hidden states ([B, T] values)
        out = token_outputs(model, batch, temperature=0.7, with_entropy=True, share_prompts=share,
                            value_head=lambda h: value_head(h).squeeze(-1))
        ((out.logp * batch.response_mask).sum() + (out.entropy * batch.response_mask).sum()
         + (out.values * batch.response_mask).sum()).backward()
        results.append((out, [p.grad.clone() for p in [*model.parameters(), *value_head.parameters()]]))
    assert len(seen) == 1 and len(seen[0].blocks) > 3  # the packed forward ran, several blocks per group
    (per_row, grads_a), (packed, grads_b) = results
    mask = batch.response_mask
    assert torch.allclose(per_row.logp * mask, packed.logp * mask, atol=1e-5)
    assert torch.allclose(per_row.entropy * mask, packed.entropy * mask, atol=1e-5)
    assert torch.allclose(per_row.values * mask, packed.values * mask, atol=1e-5)
    for a, b in zip(grads_a, grads_b):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
    lengths = batch.attention_mask[:, batch.prompt_width :].sum(-1).clamp(min=1)
    past_end = torch.arange(mask.shape[1])[None, :] >= lengths[:, None]
    assert past_end.any() and torch.all(packed.logp[past_end] == 0) and torch.all(packed.values[past_end] == 0)


def test_packed_forward_with_one_token_prompts_and_rows_longer_than_a_block(monkeypatch):
    """A one-token prompt (an empty prompt span: the token opens each response segment) and rows longer
    than a response block (each its own block) give the per-row log-probs and gradients."""
    import rlbench.training.packing as packing

    monkeypatch.setattr(packing, "BLOCK_TOKENS", 3)
    groups = [
        [Completion(0, (7,), list(resp), [0.0] * len(resp), finished=True) for resp in ([5, 6, 7, 8, 9], [], [4])],
        [Completion(1, (9, 3, 11), list(resp), [0.0] * len(resp), finished=True) for resp in ([12, 4, 4, 4], [8, 8])],
    ]
    assert_packed_equals_per_row(collate(groups, pad_token_id=0), model_seed=7, temperature=0.9)


def test_full_distribution_from_the_packed_forward_equals_the_per_row_one():
    """with_log_probs (the [B, T, V] distribution) gathers the packed positions back to rows."""
    batch = collate(completions(9, groups=2, n=3), pad_token_id=0)
    model = tiny_lm(seed=6)
    a = token_outputs(model, batch, with_log_probs=True, share_prompts=False)
    b = token_outputs(model, batch, with_log_probs=True, share_prompts=True)
    mask = batch.response_mask.bool()
    assert torch.allclose(a.log_probs[mask], b.log_probs[mask], atol=1e-5)
    assert torch.allclose(a.logp * mask, b.logp * mask, atol=1e-5)


def test_models_the_packed_attention_cannot_serve_run_one_forward_per_row(monkeypatch):
    """Eager attention, or a sliding window shorter than a row: the per-row forward, same log-probs; and
    a forward outside the packed scope while the packed attention is selected gets plain sdpa."""
    import rlbench.training.forward as forward
    from rlbench.training.packing import PACKED_ATTENTION, packing_supported

    batch = collate(completions(3, groups=3, n=4), pad_token_id=0)
    model = tiny_lm(seed=2)
    reference = token_outputs(model, batch, share_prompts=False).logp
    longest = int(batch.attention_mask.sum(-1).max())
    assert packing_supported(model, longest)
    model.config.sliding_window = longest - 1
    assert not packing_supported(model, longest)
    model.config.sliding_window = None
    model.config.layer_types = ["full_attention", "linear_attention"]  # a hybrid model would mix the packed rows
    assert not packing_supported(model, longest)
    model.config.layer_types = ["full_attention", "sliding_attention"]
    assert packing_supported(model, longest)
    model.config._attn_implementation = "eager"
    assert not packing_supported(model, longest)
    monkeypatch.setattr(forward, "pack_groups", lambda *a, **k: pytest.fail("packed on eager attention"))
    assert torch.allclose(token_outputs(model, batch).logp, reference, atol=1e-6)
    model.config._attn_implementation = PACKED_ATTENTION  # selected, but no layout: the standard attention
    assert torch.allclose(token_outputs(model, batch, share_prompts=False).logp, reference, atol=1e-6)


def test_a_model_whose_attention_bypasses_the_packed_one_is_refused(monkeypatch):
    """Every layer's attention must come through the packed attention function; a model that ran fewer
    calls (attention picked elsewhere) would have attended across rows, and the forward says so."""
    import rlbench.training.packing as packing

    batch = collate(completions(3, groups=3, n=4), pad_token_id=0)
    model = tiny_lm(seed=2)
    calls = []
    real = packing.check_attention_calls
    monkeypatch.setattr(packing, "check_attention_calls", lambda m, c: calls.append(len(c)) or real(m, c))
    import rlbench.training.forward as forward

    monkeypatch.setattr(forward, "check_attention_calls", packing.check_attention_calls)
    token_outputs(model, batch)
    assert calls == [model.config.num_hidden_layers]
    with pytest.raises(RuntimeError, match="attention calls for 2 layers"):
        real(model, [1])


def test_groups_that_pool_several_prompts_run_each_row_with_its_own_prompt():
    """rollout=equivalent_states pools responses to different prompts in one group: the shared-prompt
    forward would give them the first row's prompt; the check sends such batches down the per-row path."""
    pooled = [group_a + group_b for group_a, group_b in zip(*[completions(s, groups=2, n=2) for s in (6, 7)])]
    batch = collate(pooled, pad_token_id=0)
    assert not groups_share_prompts(batch) and groups_share_prompts(collate(completions(6, groups=2, n=2), pad_token_id=0))
    model = tiny_lm(seed=3).eval()
    per_row = token_outputs(model, batch, share_prompts=False).logp
    assert torch.allclose(token_outputs(model, batch).logp * batch.response_mask, per_row * batch.response_mask)


def test_entropy_bonus_reaches_the_gradient():
    grads = []
    for coef in (0.0, 0.5):
        algorithm = algorithm_from({
            "name": "t", "advantage": {"name": "grpo"}, "loss": {"name": "ppo_clip"},
            "aggregation": {"name": "token_mean"}, "entropy_coef": coef,
        })
        model = tiny_lm()
        opt = RecordingOptimizer(model)
        standard_update(model, opt, prepared_batch(algorithm), algorithm, micro_batch_size=4, max_grad_norm=None,
                        temperature=1.0, norm_length=6)
        grads.append(opt.steps[0])
    assert any(not torch.allclose(a, b) for a, b in zip(*grads))


# ---------------------------------------------------------------- steps without trainable tokens


def test_trainable_tokens_counts_response_tokens_the_token_mask_keeps():
    batch = collate(completions(), pad_token_id=0)
    assert trainable_tokens(batch) == int(batch.response_mask.sum().item())
    batch.token_weights = torch.zeros_like(batch.response_mask)
    batch.token_weights[0] = 1.0
    assert trainable_tokens(batch) == int(batch.response_mask[0].sum().item())
    truncated = mask_truncated(batch, torch.zeros(batch.size, dtype=torch.bool))
    assert trainable_tokens(truncated) == 0


def test_update_metrics_over_no_token_are_nan_not_zero():
    metrics = UpdateMetrics()
    metrics.add({"entropy": 0.0, "ratio_mean": 0.0, "policy_loss": 0.0}, tokens=0.0)
    result = metrics.result(optimizer_steps=1)
    assert math.isnan(result["entropy"]) and math.isnan(result["ratio_mean"])
    assert result["policy_loss"] == 0.0  # the objective itself is 0 (no term), not a statistic
    mixed = UpdateMetrics()
    mixed.add({"entropy": 2.0}, tokens=3.0)
    mixed.add({"entropy": 0.0}, tokens=0.0)  # an empty micro-batch weighs nothing
    assert mixed.result(optimizer_steps=1)["entropy"] == pytest.approx(2.0)


def test_update_on_a_fully_masked_batch_moves_nothing_and_reports_no_statistics():
    algorithm = algo("token_mean")
    model = tiny_lm()
    batch = mask_truncated(prepared_batch(algorithm), torch.zeros(12, dtype=torch.bool))
    before = [p.detach().clone() for p in model.parameters()]
    stats = standard_update(model, torch.optim.SGD(model.parameters(), lr=1.0), batch, algorithm,
                            micro_batch_size=4, max_grad_norm=None, temperature=1.0, norm_length=6)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert stats["grad_norm"] == 0.0
    for key in ("entropy", "ratio_mean", "clip_fraction"):
        assert math.isnan(stats[key]), (key, stats[key])


def test_steps_without_trainable_tokens_are_counted_and_warned_about_once(caplog):
    untrained = UntrainedSteps()
    with caplog.at_level(logging.WARNING, logger="rlbench.training.loop"):
        seen = [untrained.observe(step, {"trainable_tokens": tokens, "truncated_rate": 1.0})
                for step, tokens in enumerate([0.0, 5.0, 0.0], start=1)]
    assert [m["steps_without_trainable_tokens"] for m in seen] == [1.0, 1.0, 2.0]
    assert untrained.count == 2
    warnings = [r for r in caplog.records if "no trainable token" in r.getMessage()]
    assert len(warnings) == 1 and "step 1" in warnings[0].getMessage()
