"""Methods that need more than the training batch, checked in closed form on hand-built inputs:
ReMax's greedy baseline, PVPO's cached reference anchor, SPO's tracker across steps, polychromic
answer keys, DAPO's dynamic sampling and overlong filtering, and 2-GRPO = GRPO with n = 2."""

import logging
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import rlbench.runner as runner
from rlbench.training.advantage_inputs import (
    AdvantageInputSources,
    AnswerKeys,
    BaselineOptions,
    BaselineRewards,
    GreedyBaseline,
    ReferenceAnchor,
    SPOStream,
    answer_class_ids,
    mean_abs_logp_change,
    token_jaccard_distance,
)
from conftest import algorithm_from
from rlbench.algorithm.advantages import SPOTracker
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.reward.math import Grade
from rlbench.rollout.engines.base import Completion, SamplingParams
from rlbench.rollout.strategies.dynamic_sampling import DynamicSamplingOptions, informative_groups, sample_informative_groups
from rlbench.rollout.groups import GradedGroups
from rlbench.training.batch import collate, mask_truncated


def graded(rewards_per_group, uids=None, prompts=None, extracted=None, finished=None):
    """GradedGroups of hand-given rewards; response j of group g has response ids [g + 3, j + 3]."""
    uids = uids or [f"p{g}" for g in range(len(rewards_per_group))]
    groups, grades = [], []
    for g, rewards in enumerate(rewards_per_group):
        prompt = tuple(prompts[g]) if prompts else (g + 1, 2)
        groups.append([Completion(g, prompt, [g + 3, j + 3], [0.0, 0.0], True) for j in range(len(rewards))])
        grades += [Grade(correct=r > 0.5, extracted=None, reward=float(r), format_ok=True) for r in rewards]
    if extracted is not None:
        for grade, answer in zip(grades, extracted):
            grade.extracted = answer
    flat = [r for rewards in rewards_per_group for r in rewards]
    done = torch.ones(len(flat), dtype=torch.bool) if finished is None else torch.tensor(finished)
    rewards = torch.tensor(flat)
    problems = [Problem(uid, "q", "a") for uid in uids]
    return GradedGroups(problems, groups, grades, rewards, rewards.clone(), done, list(range(len(groups))))


def algorithm(advantage, **params):
    return algorithm_from({"name": "t", "advantage": {"name": advantage, **params},
                                  "loss": {"name": "ppo_clip"}, "aggregation": {"name": "token_mean"}})


class FakeSampler:
    """Stands in for the run's GroupSampler: per-prompt rewards from a table, calls recorded."""

    def __init__(self, rewards_by_uid):
        self.rewards_by_uid = rewards_by_uid
        self.calls = []

    def __call__(self, problems, n, params, generator, prompt_ids=None):
        self.calls.append(([p.uid for p in problems], n, params))
        rows = [self.rewards_by_uid[p.uid][:n] for p in problems]
        return graded(rows, uids=[p.uid for p in problems])


# ------------------------------------------------------------------------------ ReMax


def test_remax_advantage_is_reward_minus_greedy_reward():
    batch = graded([[1.0, 0.0], [0.5, 0.25]])
    sampler = FakeSampler({"p0": [0.25], "p1": [1.0]})
    sources = AdvantageInputSources({"baseline_rewards"}, [BaselineRewards(GreedyBaseline(sampler, SamplingParams(1.0, 0.9, 8), None))])
    inputs, metrics = sources.before_advantage(batch, collate(batch.groups, 0))
    (uids, n, params), = sampler.calls
    assert uids == ["p0", "p1"] and n == 1 and params == SamplingParams(0.0, 0.9, 8)  # one greedy response each
    assert inputs["baseline_rewards"].tolist() == [0.25, 0.25, 1.0, 1.0]
    assert metrics["baseline_reward_mean"] == pytest.approx(0.625)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    advantages = algorithm("remax").compute_advantages(batch.rewards, batch.group_index, mask, **inputs)
    expected = torch.tensor([0.75, -0.25, -0.5, -0.75])[:, None] * mask
    torch.testing.assert_close(advantages, expected)


# ------------------------------------------------------------------------------ PVPO


class RecordingEngine:
    def __init__(self):
        self.synced = []

    def sync_weights(self, model):
        self.synced.append(model)


def anchor(sampler, engine, refresh_every=None):
    options = BaselineOptions("reference", samples=3, refresh_every=refresh_every)
    return ReferenceAnchor(sampler, engine, "policy", "reference", options, SamplingParams(1.0, 1.0, 8), None)


def test_pvpo_anchor_is_the_reference_mean_computed_once_per_prompt():
    sampler = FakeSampler({"a": [1.0, 0.0, 0.2], "b": [0.0, 0.0, 0.0], "c": [1.0, 1.0, 0.4]})
    engine = RecordingEngine()
    source = anchor(sampler, engine)
    first = source(graded([[1, 1], [0, 1]], uids=["a", "b"]))
    assert first.tolist() == pytest.approx([0.4, 0.0])
    assert engine.synced == ["reference", "policy"]  # reference rollouts, then back to the policy
    assert sampler.calls[0][:2] == (["a", "b"], 3)
    second = source(graded([[1, 1], [0, 1]], uids=["c", "a"]))
    assert second.tolist() == pytest.approx([0.8, 0.4])
    assert [call[0] for call in sampler.calls] == [["a", "b"], ["c"]]  # "a" came from the cache
    assert source.generated == 3


def test_pvpo_anchor_is_refreshed_after_refresh_every_steps():
    sampler = FakeSampler({"a": [1.0, 0.0, 0.2]})
    source = anchor(sampler, RecordingEngine(), refresh_every=2)
    for _ in range(4):
        source(graded([[1, 0]], uids=["a"]))
    assert len(sampler.calls) == 2  # steps 0 and 2


def test_pvpo_all_correct_group_keeps_a_signal_through_the_sources():
    """PVPO (arXiv:2508.21104): every rollout correct, V_ref = 0.4 -> A = r - V_ref = 0.6."""
    batch = graded([[1.0, 1.0, 1.0]], uids=["x"])
    sampler = FakeSampler({"x": [1.0, 0.0, 0.2]})
    sources = AdvantageInputSources({"baseline_rewards"}, [BaselineRewards(anchor(sampler, RecordingEngine()))])
    inputs, metrics = sources.before_advantage(batch, collate(batch.groups, 0))
    assert metrics["reference_responses"] == 3
    mask = torch.ones(3, 2)
    advantages = algorithm("pvpo").compute_advantages(batch.rewards, batch.group_index, mask, **inputs)
    torch.testing.assert_close(advantages, torch.full((3, 2), 0.6))


# ------------------------------------------------------------------------------ SPO


def tiny_lm():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    return LlamaForCausalLM(config).float()


def response_logprobs(model, prompt, response):
    """log pi(response | prompt) per token, by a plain full forward pass."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    return torch.stack([logp[len(prompt) - 1 + t, token] for t, token in enumerate(response)]).double()


def test_spo_tracker_update_matches_its_formula_across_two_steps_for_the_same_uid():
    model = tiny_lm()
    tracker = SPOTracker(rho_min=0.05, rho_max=0.96, d_half=0.06)
    stream = SPOStream(tracker, model, pad_token_id=0, micro_batch_size=4, temperature=1.0, device="cpu")
    sources = AdvantageInputSources({"tracker_baseline"}, [stream])
    step1 = graded([[1.0]], uids=["u"], prompts=[(5, 6, 7)])
    inputs, _ = sources.before_advantage(step1, collate(step1.groups, 0))
    assert inputs["tracker_baseline"].tolist() == [0.5]  # unseen prompt: Beta(0.5, 0.5)
    logp_then = response_logprobs(model, (5, 6, 7), [3, 3])
    with torch.no_grad():  # "the policy step"
        model.lm_head.weight.mul_(1.5)
    sources.after_update(step1)
    # first visit: D = 0, rho = clip(2^0, rho_min, rho_max) = 0.96
    value1, weight1 = 0.96 * 1.0 * 0.5 + 1.0, 0.96 * 1.0 + 1.0
    assert tracker.state_of("u") == pytest.approx((value1 / weight1, weight1))

    step2 = graded([[0.0]], uids=["u"], prompts=[(5, 6, 7)])
    inputs, _ = sources.before_advantage(step2, collate(step2.groups, 0))
    assert inputs["tracker_baseline"].item() == pytest.approx(value1 / weight1)
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)
    metrics = sources.after_update(step2)
    change = (logp_then - response_logprobs(model, (5, 6, 7), [3, 3])).abs().mean().item()
    assert change > 0 and metrics["tracker_policy_change_mean"] == pytest.approx(change, rel=1e-4)
    rho = min(max(2.0 ** (-change / 0.06), 0.05), 0.96)
    alpha, weight2 = rho * value1 + 0.0, rho * weight1 + 1.0
    assert tracker.state_of("u") == pytest.approx((alpha / weight2, weight2), rel=1e-4)


def test_spo_constant_decay_needs_no_log_probs():
    tracker = SPOTracker(rho=0.5)
    stream = SPOStream(tracker, model=None, pad_token_id=0, micro_batch_size=4, temperature=1.0, device="cpu")
    sources = AdvantageInputSources({"tracker_baseline"}, [stream])
    for reward in (1.0, 1.0):
        step = graded([[reward]], uids=["u"])
        sources.before_advantage(step, collate(step.groups, 0))
        sources.after_update(step)
    # (0.5, 1) -r=1-> Beta(1.25, 0.25) = (5/6, 1.5) -r=1-> alpha 0.625 + 1, weight 0.75 + 1
    assert tracker.state_of("u") == pytest.approx((1.625 / 1.75, 1.75))


def test_mean_abs_logp_change_skips_padding_and_empty_rows():
    old = torch.tensor([[0.0, -1.0, 5.0], [1.0, 1.0, 1.0]])
    new = torch.tensor([[-0.5, -2.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert mean_abs_logp_change(old, new, mask).tolist() == [0.75, 0.0]


# ------------------------------------------------------------------------------ polychromic


def test_answer_keys_group_equal_canonical_answers_and_separate_missing_ones():
    keys = answer_class_ids(["1/2", "0.5", "\\frac{1}{2}", "3", None, None])
    assert keys.tolist() == [0, 0, 0, 1, -5, -6]


def test_token_jaccard_distance_closed_form():
    d = token_jaccard_distance([[1, 2, 2], [2, 3], [], []])
    expected = torch.tensor([[0, 2 / 3, 1, 1], [2 / 3, 0, 1, 1], [1, 1, 0, 0], [1, 1, 0, 0]], dtype=torch.float64)
    torch.testing.assert_close(d, expected)


def test_polychromic_rewards_a_distinct_correct_answer_through_the_grader_keys():
    """Equal rewards: the one correct response whose answer differs from the others' gains."""
    batch = graded([[1.0, 1.0, 1.0, 1.0, 0.0]], extracted=["4", "4.0", "4", "5", None])
    sources = AdvantageInputSources({"answer_keys"}, [AnswerKeys()])
    inputs, _ = sources.before_advantage(batch, collate(batch.groups, 0))
    assert inputs["answer_keys"].tolist() == [0, 0, 0, 1, -5]
    advantages = algorithm("polychromic", set_size=2).compute_advantages(
        batch.rewards, batch.group_index, torch.ones(5, 1), **inputs)[:, 0]
    # f(S) over the 10 pairs: {4,4'}-type pairs 1*0.5, pairs with "5" 1*1, pairs with the wrong one 0.5*0.5
    # -> b = (3*0.5 + 3*1 + 4*0.25) / 10 = 0.55; A_i = mean over the 4 pairs holding i of f - b
    expected = torch.tensor([(0.5 + 0.5 + 1 + 0.25) / 4, (0.5 + 0.5 + 1 + 0.25) / 4, (0.5 + 0.5 + 1 + 0.25) / 4,
                             (1 + 1 + 1 + 0.25) / 4, 0.25]) - 0.55
    torch.testing.assert_close(advantages, expected.float())
    assert advantages[3] > advantages[0]


# ------------------------------------------------------------------------------ DAPO


def test_informative_groups_are_those_with_differing_values():
    values = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    assert informative_groups(values, groups).tolist() == [False, True, False, False]


def rewards_of(uid):
    return [1.0, 0.0] if uid.startswith("mixed") else [1.0, 1.0]


def prompts_of(uids):
    return [Problem(uid, "q", "a") for uid in uids]


def test_dynamic_sampling_keeps_only_mixed_groups_and_fills_the_batch():
    queue = prompts_of(["mixed-4", "same-5", "mixed-6", "mixed-7"])
    sample = lambda problems: graded([rewards_of(p.uid) for p in problems], uids=[p.uid for p in problems])
    draws = []

    def draw(k):
        draws.append(k)
        return [queue.pop(0) for _ in range(k)]

    first = prompts_of(["same-0", "mixed-1", "same-2", "mixed-3"])
    batch, metrics = sample_informative_groups(sample, draw, first, DynamicSamplingOptions(16, "correct"))
    assert [p.uid for p in batch.problems] == ["mixed-1", "mixed-3", "mixed-4", "mixed-6"]
    assert batch.rewards.tolist() == [1.0, 0.0] * 4 and batch.group_index.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert draws == [4]
    assert metrics == {"dynamic_sampling_rounds": 2.0, "dynamic_sampling_dropped_groups": 3.0,
                       "dynamic_sampling_filled_groups": 0.0, "rollout_reward_mean": 11 / 16,
                       "rollout_outcome_mean": 11 / 16}


def test_dynamic_sampling_stops_after_max_rounds_and_fills_with_dropped_groups(caplog):
    counter = iter(range(100))
    sample = lambda problems: graded([[1.0, 1.0] for _ in problems], uids=[p.uid for p in problems])
    draw = lambda k: prompts_of([f"same-{next(counter)}" for _ in range(k)])
    with caplog.at_level(logging.WARNING):
        batch, metrics = sample_informative_groups(sample, draw, prompts_of(["a", "b", "c"]), DynamicSamplingOptions(2))
    assert [p.uid for p in batch.problems] == ["a", "b", "c"]  # the earliest dropped groups
    assert metrics["dynamic_sampling_rounds"] == 2 and metrics["dynamic_sampling_dropped_groups"] == 6
    assert metrics["dynamic_sampling_filled_groups"] == 3
    assert "max_rounds=2" in caplog.text


def test_dynamic_sampling_on_rewards_keeps_groups_that_differ_only_in_reward():
    batch = graded([[0.9, 0.8], [0.9, 0.9]])  # both groups all "correct"
    assert DynamicSamplingOptions(1, "reward").filter_values(batch).tolist() == pytest.approx([0.9, 0.8, 0.9, 0.9])
    assert informative_groups(DynamicSamplingOptions(1, "reward").filter_values(batch), batch.group_index).tolist() == [True, False]
    assert informative_groups(DynamicSamplingOptions(1, "correct").filter_values(batch), batch.group_index).tolist() == [False, False]


def test_overlong_filter_zeroes_the_loss_and_gradient_of_truncated_responses():
    batch = collate([[Completion(0, (1, 2), [3, 4, 5], [0.0] * 3, False), Completion(0, (1, 2), [6, 7], [0.0] * 2, True)]], 0)
    batch.advantages = torch.tensor([[2.0, 2.0, 2.0], [-3.0, -3.0, 0.0]])
    masked = mask_truncated(batch, torch.tensor([False, True]))
    assert masked.response_mask.tolist() == [[0, 0, 0], [1, 1, 0]]
    assert masked.advantages[0].abs().sum() == 0 and batch.response_mask[0].sum() == 3  # the input is kept
    logp = torch.zeros(2, 3, requires_grad=True)
    dapo = algorithm("grpo")
    loss, _ = dapo.compute_loss(logp=logp, old_logp=logp.detach(), advantages=masked.advantages,
                                response_mask=masked.response_mask, norms={"batch_tokens": 2, "batch_sequences": 2,
                                                                           "norm_length": 3})
    loss.backward()
    # ppo_clip at ratio 1: -A per token; token_mean over the 2 kept tokens: -(-3 - 3) / 2 = 3
    assert loss.item() == pytest.approx(3.0)
    assert logp.grad.tolist() == [[0.0, 0.0, 0.0], [1.5, 1.5, 0.0]]


# ------------------------------------------------------------------------------ 2-GRPO


def test_two_grpo_equals_grpo_with_two_responses_per_prompt(make_cfg):
    two, grpo = make_cfg("algorithm=two_grpo"), make_cfg("algorithm=grpo", "rollout.n=2")
    assert two.rollout.n == grpo.rollout.n == 2
    a, b = algorithm_from(two.algorithm), algorithm_from(grpo.algorithm)
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.3, 0.9])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    mask = torch.tensor([[1.0, 1.0, 1.0]] * 3 + [[1.0, 0.0, 0.0]] * 3)
    adv_a, adv_b = (algo.compute_advantages(rewards, groups, mask) for algo in (a, b))
    torch.testing.assert_close(adv_a, adv_b)
    s = 1 / math.sqrt(2)  # +-(r1 - r2) / (2 std) with the unbiased std: +-1/sqrt(2)
    assert adv_a[:, 0].tolist() == pytest.approx([s, -s, 0.0, 0.0, -s, s], abs=1e-5)
    gradients = []
    for algo, adv in ((a, adv_a), (b, adv_b)):
        logp = torch.linspace(-2.0, -0.1, 18).reshape(6, 3).requires_grad_()
        loss, _ = algo.compute_loss(logp=logp, old_logp=logp.detach() + 0.1, advantages=adv, response_mask=mask,
                                    norms={"batch_tokens": 12, "batch_sequences": 6, "norm_length": 3})
        loss.backward()
        gradients.append((loss.item(), logp.grad))
    assert gradients[0][0] == pytest.approx(gradients[1][0])
    torch.testing.assert_close(gradients[0][1], gradients[1][1])


# ------------------------------------------------------------------------------ presets and validation


@pytest.mark.parametrize("preset,n", [("spo", 1), ("remax", 1), ("two_grpo", 2), ("polychromic", 8), ("grpo", 4)])
def test_presets_set_their_group_size_and_an_explicit_one_wins(make_cfg, preset, n):
    assert make_cfg(f"algorithm={preset}").rollout.n == n
    assert make_cfg(f"algorithm={preset}", "rollout.n=3").rollout.n == 3


@pytest.mark.parametrize("overrides,message", [
    (["algorithm=spo", "algorithm/advantage=grpo"], "rollout.n >= 2"),
    (["algorithm=spo", "rollout=dynamic_sampling", "rollout.n=2"], "dynamic_sampling"),
    (["algorithm=remax", "rollout=dynamic_sampling"], "needs rollout.n >= 2"),
    (["algorithm=dapo", "rollout.dynamic_sampling.metric=acc"], "metric='acc' is unknown"),
    (["algorithm=dapo", "+rollout.dynamic_sampling.rounds=3"], r"rollout.dynamic_sampling has no key\(s\) \['rounds'\].*did you mean 'rounds' -> 'max_rounds'"),
    (["algorithm=dapo", "+algorithm.dynamic_sampling.enabled=true"], "moved to the rollout strategy"),
    (["rollout.strategy=forest"], r"rollout.strategy='forest' is unknown; choose one of \[.*'iid'.*\]"),
    (["algorithm=polychromic", "rollout.n=4"], "set_size=4"),
    (["algorithm=spo", "reward.incorrect_reward=-1"], r"\[0, 1\]"),
    (["algorithm=spo", "algorithm.tracker.rho_min=0.99"], "rho_min <= rho_max"),
    (["algorithm=remax", "algorithm.baseline.source=oracle"], "baseline.source"),
    (["algorithm=pvpo", "algorithm.baseline.samples=0"], "samples must be >= 1"),
])
def test_impossible_configurations_are_refused_before_loading(make_cfg, monkeypatch, overrides, message):
    monkeypatch.setattr(runner, "load_policy", lambda *a, **k: pytest.fail("model loaded before validation"))
    with pytest.raises(ConfigError, match=message):
        runner.run(make_cfg(*overrides))
