"""Behaviour-policy bookkeeping: which policy produced each token, and the pi_old the ratio uses.

A token the policy being trained did not sample at this step (a teacher's trace, a replayed or stale
response, an edited token) must never get a silently recomputed pi_old (ratio 1): its stored
behaviour log-prob is pi_old, and a trained token without one is refused."""

import math

import pytest
import torch

from rlbench.rollout.engines.base import Completion
from rlbench.training.batch import collate, last_trained_position
from rlbench.training.step import behaviour_old_logp
from rlbench.training.update import micro_batch_loss


def completion(tokens, logprobs, **kw):
    return Completion(0, (1, 2), list(tokens), list(logprobs), True, **kw)


def test_on_policy_batch_has_no_off_policy_fields():
    batch = collate([[completion([3, 4], [-0.1, -0.2], policy_version=5)]], 0, current_version=5)
    assert batch.off_policy is None and batch.behaviour_logp is None and not batch.has_off_policy
    assert batch.policy_version.tolist() == [5]


def test_stale_response_is_off_policy_in_every_token_with_its_sampling_logprobs_as_behaviour():
    fresh = completion([3, 4], [-0.1, -0.2], policy_version=7)
    stale = completion([5, 6, 7], [-0.3, -0.4, -0.5], policy_version=5)
    batch = collate([[fresh, stale]], 0, current_version=7)
    assert batch.off_policy.tolist() == [[0, 0, 0], [1, 1, 1]]
    assert torch.allclose(batch.behaviour_logp[1], torch.tensor([-0.3, -0.4, -0.5]))


def test_explicit_token_labels_and_behaviour_logprobs_win():
    trace = completion([3, 4, 5], [0.0, 0.0, 0.0], behaviour="teacher", off_policy=[0, 1, 1],
                       behaviour_logprobs=[0.0, -1.5, math.nan])
    batch = collate([[trace]], 0, current_version=0)
    assert batch.off_policy.tolist() == [[0, 1, 1]]
    assert batch.behaviour_logp[0, 1].item() == -1.5 and math.isnan(batch.behaviour_logp[0, 2].item())
    with pytest.raises(ValueError, match="off_policy has 2 entries for 3"):
        collate([[completion([3, 4, 5], [0.0] * 3, off_policy=[1, 1])]], 0)


def test_loss_mask_takes_context_tokens_out_of_training_and_select_keeps_tokens_after_the_hole():
    with_hint = completion([3, 4, 5, 6], [0.0] * 4, loss_mask=[1, 0, 0, 1])
    batch = collate([[with_hint, completion([3], [0.0])]], 0)
    assert batch.response_mask.tolist() == [[1, 0, 0, 1], [1, 0, 0, 0]]
    assert last_trained_position(batch.response_mask) == 4
    sub = batch.select(torch.tensor([0]))
    assert sub.response_mask.tolist() == [[1, 0, 0, 1]]
    assert batch.select(torch.tensor([1])).response_mask.shape[1] == 1


def test_old_logp_is_the_stored_behaviour_logprob_on_off_policy_tokens():
    batch = collate([[completion([3, 4], [-0.1, -0.2], policy_version=1),
                      completion([5, 6], [-0.7, -0.9], policy_version=0)]], 0, current_version=1)
    recomputed = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]])
    old = behaviour_old_logp(batch, recomputed)
    assert torch.allclose(old, torch.tensor([[-1.0, -2.0], [-0.7, -0.9]]))


def test_unknown_behaviour_logprob_on_a_trained_token_is_refused_but_allowed_when_masked():
    unknown = completion([3, 4], [0.0, 0.0], behaviour="teacher", off_policy=[1, 1],
                         behaviour_logprobs=[math.nan, math.nan])
    batch = collate([[unknown]], 0)
    with pytest.raises(ValueError, match="no behaviour log-prob"):
        behaviour_old_logp(batch, torch.zeros(1, 2))
    context_only = completion([3, 4], [0.0, 0.0], off_policy=[1, 0], behaviour_logprobs=[math.nan, -0.5], loss_mask=[0, 1])
    batch = collate([[context_only]], 0)
    assert torch.equal(behaviour_old_logp(batch, torch.full((1, 2), -2.0)), torch.tensor([[-2.0, -2.0]]))


def test_the_update_never_falls_back_to_ratio_one_for_off_policy_tokens():
    model = torch.nn.Module()  # never reached: the check precedes the forward
    batch = collate([[completion([3, 4], [-0.5, -0.5], policy_version=0)]], 0, current_version=2)
    batch.advantages = torch.ones(1, 2)
    with pytest.raises(ValueError, match="not ratio 1"):
        micro_batch_loss(model, batch, None, {}, 1.0)


def test_generation_cost_counts_generated_and_reused_tokens_and_resets():
    from rlbench.rollout.groups import GenerationCost

    cost = GenerationCost()
    groups = [[completion([3, 4, 5], [0.0] * 3, prefix_len=2), completion([6], [0.0])], [completion([], [])]]
    cost.add(groups, 0.5)
    cost.add([[completion([7, 8], [0.0] * 2)]], 0.25)
    assert cost.take() == {"generated_tokens": 4.0, "reused_tokens": 2.0, "generated_responses": 4.0, "engine_s": 0.75}
    assert cost.take()["generated_tokens"] == 0.0
