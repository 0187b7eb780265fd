"""Experience replay (rlbench/rollout/guided/replay.py) and AR3PO's adaptive rollout (rlbench/rollout/guided/adaptive.py):
buffer invariants (capacity, bucket weights, retirement, trajectory choice, determinism, checkpoint round
trip), the strategies' groups, and the pi_old their replayed tokens get."""

import io
import math

import pytest
import torch

from rlbench.config.typed import rollout_config
from rlbench.algorithm.losses import exgrpo_loss, ppo_clip_loss
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.reward.toy import EvenTokenReward
from rlbench.rollout import GroupSampler, RolloutSetup, make_strategy, validate_strategy
from rlbench.rollout.engines.base import Completion, PositionStats, SamplingParams
from rlbench.rollout.guided.replay import ReplayBuffer, bucket_weight
from rlbench.training.batch import collate
from rlbench.training.step import behaviour_old_logp, stamp_policy_version


def response(tokens, logprobs=None, version=0, uid_prompt=(7,)):
    logprobs = [-0.5] * len(tokens) if logprobs is None else logprobs
    return Completion(0, uid_prompt, list(tokens), list(logprobs), True, policy_version=version)


def problem(uid):
    return Problem(uid, f"question {uid}", "a", {"level": 1})


def filled_buffer(accuracies, seed=0, **kw):
    """A buffer holding one correct response per question uid -> its accuracy."""
    buffer = ReplayBuffer(capacity=100, seed=seed, **kw)
    for uid, accuracy in accuracies.items():
        buffer.observe(problem(uid), [response([2])], [True])
        buffer.accuracy[uid] = accuracy
    return buffer


# ------------------------------------------------------------------------------------------ the buffer


def test_capacity_keeps_the_newest_responses_and_forgets_emptied_questions():
    buffer = ReplayBuffer(capacity=3, seed=0)
    buffer.observe(problem("a"), [response([1]), response([2]), response([3])], [True, False, True])
    assert [item.response_ids for item in buffer.items] == [[1], [3]]  # only correct responses enter
    buffer.observe(problem("b"), [response([4]), response([5])], [True, True])
    assert [item.response_ids for item in buffer.items] == [[3], [4], [5]] and len(buffer) == 3
    buffer.observe(problem("c"), [response([6]), response([8])], [True, True])
    assert [(item.uid, item.response_ids) for item in buffer.items] == [("b", [5]), ("c", [6]), ("c", [8])]
    assert list(buffer.problems) == ["b", "c"]  # "a" lost its last response


def test_a_response_enters_only_with_its_policy_version():
    with pytest.raises(ValueError, match="policy version"):
        ReplayBuffer(4, 0).observe(problem("a"), [response([2], version=None)], [True])


def test_bucket_weights_follow_the_gaussian_over_non_empty_buckets():
    # accuracies: two questions at 0.5, one at 0.25, one at 1.0; weight N(acc; 0.5, 0.25)
    buffer = filled_buffer({"a": 0.5, "b": 0.5, "c": 0.25, "d": 1.0}, weighting="accuracy_gaussian",
                           weight_mean=0.5, weight_std=0.25)
    w = {acc: math.exp(-0.5 * ((acc - 0.5) / 0.25) ** 2) for acc in (0.5, 0.25, 1.0)}
    total = sum(w.values())
    expected = {"a": w[0.5] / total / 2, "b": w[0.5] / total / 2, "c": w[0.25] / total, "d": w[1.0] / total}
    probs = buffer.question_probabilities()
    assert probs == pytest.approx(expected)
    assert sum(probs.values()) == pytest.approx(1.0)
    assert bucket_weight(0.5, 0.5, 0.25) == 1.0 and bucket_weight(1.0, 0.5, 0.25) == pytest.approx(math.exp(-2))
    # an excluded question leaves its bucket; the bucket's share stays while it has members
    probs = buffer.question_probabilities(exclude={"b"})
    assert probs["a"] == pytest.approx(w[0.5] / total)
    # uniform weighting
    assert filled_buffer({"a": 0.5, "b": 0.1}).question_probabilities() == {"a": 0.5, "b": 0.5}


def test_draws_follow_the_question_probabilities():
    buffer = filled_buffer({"a": 0.5, "b": 0.25, "c": 0.875}, weighting="accuracy_gaussian", weight_mean=0.5, weight_std=0.2)
    expected = buffer.question_probabilities()
    draws = 6000
    counts = {uid: 0 for uid in expected}
    for _ in range(draws):
        counts[buffer.sample_questions(1)[0].uid] += 1
    for uid, p in expected.items():  # 5 binomial standard deviations
        assert abs(counts[uid] / draws - p) < 5 * math.sqrt(p * (1 - p) / draws), (uid, counts, expected)


def test_solved_questions_are_retired_for_good():
    buffer = ReplayBuffer(capacity=10, seed=0, retire_solved=True)
    buffer.observe(problem("a"), [response([2]), response([3])], [True, False])
    assert buffer.stored("a") and buffer.accuracy["a"] == 0.5
    buffer.observe(problem("a"), [response([4]), response([6])], [True, True])
    assert "a" in buffer.retired and not buffer.stored("a") and "a" not in buffer.problems
    buffer.observe(problem("a"), [response([8]), response([9])], [True, False])
    assert not buffer.stored("a") and buffer.sample_questions(3) == []
    # without retirement a solved question stays
    keep = ReplayBuffer(capacity=10, seed=0)
    keep.observe(problem("a"), [response([4]), response([6])], [True, True])
    assert len(keep.stored("a")) == 2 and not keep.retired


def test_lowest_entropy_trajectories_are_ranked_by_the_given_current_policy_entropies():
    buffer = ReplayBuffer(capacity=10, seed=0, trajectory="lowest_entropy")
    buffer.observe(problem("a"), [response([1, 2]), response([3]), response([4, 5])], [True, True, True])
    assert [item.response_ids for item in buffer.sample_trajectories("a", 2, [0.9, 0.4, 0.1])] == [[4, 5], [3]]
    assert [item.response_ids for item in buffer.sample_trajectories("a", 1, [0.2, 0.2, 0.3])] == [[1, 2]]  # tie: older
    assert len(buffer.sample_trajectories("a", 9)) == 3  # no choice to make: no entropies needed
    assert buffer.sample_trajectories("missing", 2) == []
    with pytest.raises(ValueError, match="one entropy per stored response"):
        buffer.sample_trajectories("a", 1)


def test_draws_are_deterministic_under_a_seed_and_resume_exactly_from_a_checkpoint():
    accuracies = {str(i): i / 8 for i in range(1, 8)}
    first = filled_buffer(accuracies, seed=3, weighting="accuracy_gaussian", weight_std=0.125)
    same = filled_buffer(accuracies, seed=3, weighting="accuracy_gaussian", weight_std=0.125)
    other = filled_buffer(accuracies, seed=4, weighting="accuracy_gaussian", weight_std=0.125)
    draw = lambda b: [p.uid for _ in range(20) for p in b.sample_questions(2)]
    assert draw(first) == draw(same) != draw(other)
    file = io.BytesIO()
    torch.save(first.state_dict(), file)
    file.seek(0)
    resumed = ReplayBuffer(capacity=100, seed=99, weighting="accuracy_gaussian", weight_std=0.125)
    resumed.load_state_dict(torch.load(file, weights_only=True))
    assert resumed.items == first.items and resumed.accuracy == first.accuracy
    assert list(resumed.problems.values()) == list(first.problems.values())
    assert draw(resumed) == draw(first)


# ------------------------------------------------------------------------------------ the strategies


class ScriptedEngine:
    """Prompt (k,) -> n copies of ``script[k]`` with log-prob -0.25 per token (then a scripted second round)."""

    def __init__(self, script):
        self.script, self.calls, self.scored, self.entropy = script, [], [], {}

    def generate(self, requests, params, generator=None):
        self.calls.append([(r.prompt_ids[0], r.n) for r in requests])
        out = []
        for i, r in enumerate(requests):
            tokens = self.script[r.prompt_ids[0]]
            tokens = tokens[min(len(self.calls), len(tokens)) - 1] if isinstance(tokens[0], list) else tokens
            out.append([Completion(i, r.prompt_ids, list(tokens), [-0.25] * len(tokens), True) for _ in range(r.n)])
        return out

    def position_stats(self, items, params):
        """The current policy's per-token entropy of a response: ``entropy[response]`` (default 1.0 a token)."""
        self.scored.append(list(items))
        return [PositionStats(torch.zeros(len(x), 2, dtype=torch.long), torch.zeros(len(x), 2),
                              torch.tensor(self.entropy.get(tuple(x), [1.0] * len(x)), dtype=torch.float64), 10)
                for _, x in items]


class Tokenizer:
    def decode(self, ids):
        return " ".join(map(str, ids))


def strategy_for(script, rollout, n=2, seed=0):
    class Sampler(GroupSampler):
        def sample(self, problems, n, params, generator, prompt_ids=None):
            return super().sample(problems, n, params, generator, [(int(p.uid),) for p in problems])

    sampler = Sampler(ScriptedEngine(script), EvenTokenReward(threshold=0.75), Tokenizer(), {}, lambda r, _: r)
    cfg = rollout_config({"n": n, **rollout})
    validate_strategy(cfg, "grpo")
    return make_strategy(cfg, RolloutSetup(sampler, n, SamplingParams(1.0, 1.0, 4), None, seed)), sampler.engine


def run_steps(strategy, prompts, steps):
    """Steps of the strategy, each stamped with its policy version as train_step does."""
    out = []
    for version in range(steps):
        graded, metrics = strategy.rollout([problem(u) for u in prompts])
        stamp_policy_version(graded, version)
        out.append((graded, metrics))
    return out


def test_rlep_groups_hold_fresh_responses_plus_stored_successes_of_the_same_question():
    # prompt 0 answers [2, 4] (correct), prompt 1 answers [1, 3] (wrong): only prompt 0 has successes
    strategy, engine = strategy_for({0: [2, 4], 1: [1, 3]}, {"strategy": "replay", "replay": {"per_group": 2}}, n=3)
    (first, m1), (second, m2) = run_steps(strategy, ["0", "1"], 2)
    assert [len(g) for g in first.groups] == [3, 3] and m1["replay_responses"] == 0 and m1["replay_shortfall"] == 4
    assert [len(g) for g in second.groups] == [5, 3]  # n fresh + 2 replayed; the wrong prompt has none
    assert m2["replay_responses"] == 2 and m2["replay_shortfall"] == 2
    replayed = second.groups[0][3:]
    assert [c.behaviour for c in replayed] == ["replay", "replay"] and all(c.policy_version == 0 for c in replayed)
    assert engine.calls[1] == [(0, 3), (1, 3)]  # fresh counts are not reduced without replace_fresh
    batch = collate(second.groups, 0, current_version=1)
    assert batch.off_policy[3:5].sum().item() == 4 and batch.off_policy[:3].sum().item() == 0
    old = behaviour_old_logp(batch, torch.full(batch.response_mask.shape, -9.0))
    assert torch.all(old[3:5, :2] == -0.25) and torch.all(old[:3, :2] == -9.0)  # stored mu, never recomputed


def test_recomputed_behaviour_declares_replayed_tokens_on_policy():
    strategy, _ = strategy_for({0: [2, 4]}, {"strategy": "replay", "replay": {"per_group": 1, "behaviour": "recomputed"}})
    (_, _), (second, _) = run_steps(strategy, ["0"], 2)
    replayed = second.groups[0][-1]
    assert replayed.behaviour == "replay_recomputed" and replayed.off_policy == [0, 0]
    batch = collate(second.groups, 0, current_version=1)
    assert batch.off_policy is None  # pi_old is the current policy's on every token (RLEP's, AR3PO's rule)


def test_exgrpo_mix_draws_buffer_questions_with_n_minus_one_fresh_responses():
    script = {0: [2, 4], 1: [2, 3], 2: [1, 3], 3: [2, 2]}
    rollout = {"strategy": "replay", "replay": {"per_group": 1, "questions": "buffer", "buffer_share": 0.5,
                                                 "replace_fresh": True, "trajectory": "lowest_entropy"}}
    strategy, engine = strategy_for(script, rollout, n=4)
    run_steps(strategy, ["0", "3"], 1)  # fills the buffer with questions 0 and 3
    graded, metrics = strategy.rollout([problem("1"), problem("2")])
    # one of the two groups is a buffer question (0 or 3, not among the step's prompts) with 3 fresh + 1 replayed
    assert graded.problems[0].uid == "1" and graded.problems[1].uid in {"0", "3"}
    assert [len(g) for g in graded.groups] == [4, 4] and engine.calls[-1][1][1] == 3
    assert graded.groups[1][-1].behaviour == "replay" and metrics["replay_responses"] == 1


def test_exgrpo_mix_replays_only_into_buffer_questions_when_the_step_prompts_are_in_the_buffer():
    """ExGRPO's mix (arXiv:2510.02245, section 3.2): a buffer question gets 1 replayed + n - 1 fresh
    responses, a fresh question n fresh ones, even when the buffer holds successes of the fresh question
    (keep=correct). Before the fix every prompt with stored successes got a replayed response: 2 of 2 groups."""
    script = {0: [2, 4], 1: [2, 2], 2: [4, 4], 3: [2, 6]}  # every answer correct: all four enter the buffer
    rollout = {"strategy": "replay", "replay": {"per_group": 1, "questions": "buffer", "buffer_share": 0.5,
                                                 "replace_fresh": True, "keep": "correct"}}
    strategy, engine = strategy_for(script, rollout, n=4)
    (_, _), (graded, metrics) = run_steps(strategy, ["0", "1", "2", "3"], 2)  # the first step fills the buffer
    replayed = [sum(c.behaviour == "replay" for c in group) for group in graded.groups]
    # half of the 4 groups are buffer questions, drawn from the buffer's questions other than the step's own
    # prompts; with every held question among them the buffer has none to give: all 4 groups stay fresh
    assert replayed == [0, 0, 0, 0] and metrics["replay_shortfall"] == 2
    graded, metrics = strategy.rollout([problem("0"), problem("1")])
    replayed = [sum(c.behaviour == "replay" for c in group) for group in graded.groups]
    assert [p.uid for p in graded.problems][0] == "0" and graded.problems[1].uid in {"2", "3"}
    assert replayed == [0, 1] and metrics["replay_responses"] == 1  # 1 of 2 groups mixes, as ExGRPO
    assert [len(g) for g in graded.groups] == [4, 4]
    assert engine.calls[-1] == [(0, 4), (int(graded.problems[1].uid), 3)]  # n fresh; n - 1 fresh + 1 replayed


def test_exgrpo_replays_the_success_of_lowest_entropy_under_the_current_policy_not_the_behaviour_policy():
    """ExGRPO's trajectory choice (arXiv:2510.02245, section 3.2): of a question's stored successes, the one of
    lowest mean token entropy under the policy about to be updated. Success a was sampled confidently (stored
    log-probs -0.01: behaviour entropy estimate 0.01), b hesitantly (-2.0: 2.0); the current policy is now sure
    of b (entropies 0.1, 0.3: mean 0.2) and unsure of a (1.5, 1.5: mean 1.5), so b is replayed. Ranking by the
    stored log-probs (the earlier rule) replays a."""
    rollout = {"strategy": "replay", "replay": {"per_group": 1, "questions": "buffer", "buffer_share": 0.5,
                                                 "replace_fresh": True, "weighting": "accuracy_gaussian",
                                                 "weight_std": 0.125, "trajectory": "lowest_entropy"}}

    def replayed_under(entropy):
        strategy, engine = strategy_for({0: [1, 3], 1: [1, 3], 100: [1, 3]}, rollout, n=4)
        a, b = response([2, 4], [-0.01, -0.01]), response([4, 6], [-2.0, -2.0])
        strategy.buffer.observe(problem("100"), [a, b, response([1, 3])], [True, True, False])
        engine.entropy = entropy
        graded, metrics = strategy.rollout([problem("0"), problem("1")])
        assert graded.problems[1].uid == "100" and graded.groups[1][-1].behaviour == "replay"
        assert engine.scored == [[((7,), (2, 4)), ((7,), (4, 6))]]  # one forward of both candidates
        assert metrics["replay_entropy_scored"] == 2
        return graded.groups[1][-1]

    chosen = replayed_under({(2, 4): [1.5, 1.5], (4, 6): [0.1, 0.3]})
    assert chosen.response_ids == [4, 6] and chosen.logprobs == [-2.0, -2.0]  # its stored mu travels with it
    assert replayed_under({(2, 4): [0.1, 0.1], (4, 6): [0.1, 0.3]}).response_ids == [2, 4]  # now a: 0.1 < 0.2


def test_replay_waits_for_the_start_accuracy():
    rollout = {"strategy": "replay", "replay": {"per_group": 1, "start_accuracy": 0.75}}
    strategy, _ = strategy_for({0: [[2, 4], [2, 4]], 1: [[1, 3], [2, 4]]}, rollout)
    steps = run_steps(strategy, ["0", "1"], 3)
    assert [m["replay_started"] for _, m in steps] == [0.0, 1.0, 1.0]  # step 2's accuracy 1.0 >= 0.75
    assert [m["replay_responses"] for _, m in steps] == [0.0, 0.0, 2.0]


def test_strategy_state_round_trip_continues_identically():
    script = {i: ([2, 4] if i % 2 else [2, 3]) for i in range(6)}
    rollout = {"strategy": "replay", "replay": {"per_group": 1, "questions": "buffer", "replace_fresh": True}}
    a, _ = strategy_for(script, rollout, n=2, seed=5)
    run_steps(a, ["1", "3", "5"], 2)
    b, _ = strategy_for(script, rollout, n=2, seed=77)
    b.load_state_dict(a.state_dict())
    ga, _ = a.rollout([problem("0"), problem("2")])
    gb, _ = b.rollout([problem("0"), problem("2")])
    assert [p.uid for p in ga.problems] == [p.uid for p in gb.problems]


@pytest.mark.parametrize("block, message", [
    ({"per_group": -1}, "per_group must be >= 1"),
    ({"per_group": 2, "replace_fresh": True}, "per_group must be < rollout.n"),
    ({"questions": "all"}, "questions='all'"),
    ({"behaviour": "fresh"}, "behaviour='fresh'"),
    ({"weight_std": 0}, "weight_std must be > 0"),
    ({"capcity": 4}, r"has no key\(s\) \['capcity'\]"),
])
def test_bad_replay_options_are_refused_before_anything_loads(block, message):
    with pytest.raises(ConfigError, match=message):
        validate_strategy(rollout_config({"strategy": "replay", "n": 2, "replay": block}), "grpo")


# --------------------------------------------------------------------------------------------- AR3PO


def test_adaptive_rollout_stops_resolved_prompts_and_reuses_a_stored_success():
    # prompt 0 is always right; prompt 1 is right at the first call only, then always wrong
    script = {0: [2, 4], 1: [[2, 4], [1, 3], [1, 3], [1, 3], [1, 3]]}
    rollout = {"strategy": "adaptive", "adaptive": {"stages": 2}}
    strategy, engine = strategy_for(script, rollout, n=4)
    (first, m1), (second, m2) = run_steps(strategy, ["0", "1"], 2)
    assert engine.calls[0] == [(0, 2), (1, 2)]  # both resolved in stage 1: one call
    assert [len(g) for g in first.groups] == [2, 2] and m1["adaptive_stages"] == 1
    # step 2: prompt 1 wrong in both stages -> 2 + 2 fresh + 1 reused success; prompt 0 stops after stage 1
    assert engine.calls[1:] == [[(0, 2), (1, 2)], [(1, 2)]]
    assert [len(g) for g in second.groups] == [2, 5] and m2["replay_responses"] == 1
    reused = second.groups[1][-1]
    assert reused.behaviour == "replay_recomputed" and reused.off_policy == [0, 0] and reused.response_ids == [2, 4]
    assert second.correct.tolist()[-1] == 1.0


def test_adaptive_stages_must_divide_the_group_size():
    with pytest.raises(ConfigError, match="divide rollout.n=4"):
        validate_strategy(rollout_config({"strategy": "adaptive", "n": 4, "adaptive": {"stages": 3}}), "grpo")


# ------------------------------------------------------------------------------------ the exgrpo loss


def test_exgrpo_loss_is_the_unclipped_policy_gradient_on_own_tokens_and_shapes_replayed_ones():
    """arXiv:2510.02245, section 3.3: -A rho on the policy's own tokens (no clip), -A w / (w + beta) on replayed."""
    logp = torch.tensor([[-0.5, -2.0], [-0.2, -3.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -1.0], [-1.2, -1.0]])
    adv = torch.tensor([[1.0, -2.0], [2.0, 2.0]])
    mask = torch.ones(2, 2)
    off = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    loss, metrics = exgrpo_loss(logp, old, adv, mask, off, shaping_beta=0.1)
    # own tokens, both ratios outside PPO's [0.8, 1.2]: rho = e^0.5 = 1.64872 with A = 1, rho = e^-1 = 0.36788 with A = -2
    assert loss[0].tolist() == pytest.approx([-1.648721, 0.735759], abs=1e-6)  # -A rho, not PPO's -1.2 and 1.6
    ppo, _ = ppo_clip_loss(logp, old, adv, mask)
    assert ppo[0].tolist() == pytest.approx([-1.2, 1.6])  # what the earlier PPO-clip gave (gradient 0 on both)
    loss[0].sum().backward(retain_graph=True)
    assert logp.grad[0].tolist() == pytest.approx([-1.648721, 0.735759], abs=1e-6)  # d(-A rho)/d logp = -A rho
    logp.grad = None
    w = torch.exp(logp[1] - old[1]).detach()
    assert torch.allclose(loss[1], -adv[1] * w / (w + 0.1))  # replayed: -A w / (w + beta), w = e^1 unclipped
    loss[1].sum().backward()
    assert torch.allclose(logp.grad[1], -adv[1] * 0.1 * w / (w + 0.1) ** 2)
    assert metrics["replay_weight_mean"] == pytest.approx(float((w / (w + 0.1)).mean()))
    assert float((w / (w + 0.1)).max()) < 1
