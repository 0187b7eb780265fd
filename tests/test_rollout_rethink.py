"""Cog-Rethinker re-rollouts (rlbench/rollout/strategies/rethink.py, arXiv:2510.15979)."""

from __future__ import annotations

import io
import math

import pytest
import torch

from conftest import CharTokenizer, smoke_cli_steps
from rlbench.config.typed import rollout_config
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.reward.math import Grade
from rlbench.rollout import GroupSampler, RolloutSetup, make_strategy, validate_strategy
from rlbench.rollout.engines.base import Completion, SamplingParams
from rlbench.rollout.strategies.rethink import RethinkOptions, RethinkRollout, bm25_scores, stage_problem, top_k
from rlbench.training.batch import collate
from rlbench.training.step import behaviour_old_logp
from rlbench.validation import validate_config


class Engine:
    """Problem "easy" is answered "y" directly; "hard" only under the refine prompt ("wrong" in it);
    "never" is never answered right. Answers are one token with log-prob -0.5."""

    def __init__(self):
        self.prompts = []

    def generate(self, requests, params, generator=None):
        out = []
        for i, r in enumerate(requests):
            text = "".join(chr(t) for t in r.prompt_ids)
            self.prompts.append(text)
            answer = "y" if "easy" in text or ("hard" in text and "wrong" in text) else "n"
            out.append([Completion(i, r.prompt_ids, [ord(answer)], [-0.5], True, text=answer) for _ in range(r.n)])
        return out


class Grader:
    def __call__(self, text, answer, response_ids):
        return Grade(correct=text == "y", extracted=text, reward=float(text == "y"), format_ok=True)


def test_unsolved_problems_go_through_decompose_then_refine_and_a_success_joins_off_policy():
    sampler = GroupSampler(Engine(), Grader(), CharTokenizer(), {"user": "Q: {problem}"}, lambda r, _: r)
    setup = RolloutSetup(sampler, 3, SamplingParams(1.0, 1.0, 4), None)
    options = RethinkOptions(samples=2, shown_attempts=2, decompose_template="Split: {problem}",
                             refine_template="{problem} | {attempts} | wrong?", successes="off_policy",
                             demonstrations=0)
    problems = [Problem("1", "easy", "y"), Problem("2", "hard", "y"), Problem("3", "never", "y")]
    groups, metrics = RethinkRollout(setup, options).rollout(problems)
    assert metrics == {"rethink_successes": 2.0, "rethink_zero_accuracy_prompts": 2.0, "rethink_decompose_solved": 0.0,
                       "rethink_refine_solved": 1.0}  # both refine samples of "hard" correct; the first joins its group
    prompts = sampler.engine.prompts
    assert prompts[3:5] == ["Q: Split: hard", "Q: Split: never"]  # the stage inside the dataset's template
    assert prompts[5:] == ["Q: hard | - n\n- n | wrong?", "Q: never | - n\n- n | wrong?"]
    easy, hard, never = groups.groups
    assert [c.behaviour for c in hard] == ["policy", "policy", "rethink"] and all(c.behaviour == "policy" for c in never)
    success = hard[-1]
    assert success.prompt_ids == hard[0].prompt_ids == tuple(ord(c) for c in "Q: hard")  # the direct prompt
    assert success.off_policy == [1] and success.behaviour_logprobs == [-0.5]
    assert groups.rewards.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    # the trainer takes pi_old of the re-attached tokens from their stage log-probs, never from the direct prompt
    batch = collate(groups.groups, pad_token_id=0, current_version=0)
    recomputed = torch.full_like(batch.response_mask, -9.0)
    old = behaviour_old_logp(batch, recomputed)
    assert old[5, 0].item() == -0.5 and old[4, 0].item() == -9.0


def test_by_default_a_success_is_an_sft_target_under_the_direct_prompt_in_a_group_of_its_own():
    """The paper's rule (arXiv:2510.15979, section 3): the direct groups stay as sampled (plain GRPO); the
    refine stage's success of "hard" comes after them as a group of one under the direct prompt, its
    tokens marked sft_target 1 (every other token 0), and its GRPO advantage is 0."""
    from rlbench.algorithm.advantages.group_relative import grpo_advantage

    sampler = GroupSampler(Engine(), Grader(), CharTokenizer(), {"user": "Q: {problem}"}, lambda r, _: r)
    setup = RolloutSetup(sampler, 3, SamplingParams(1.0, 1.0, 4), None)
    options = RethinkOptions(samples=1, shown_attempts=2, decompose_template="Split: {problem}",
                             refine_template="{problem} | {attempts} | wrong?", demonstrations=0)
    problems = [Problem("1", "easy", "y"), Problem("2", "hard", "y"), Problem("3", "never", "y")]
    graded, metrics = RethinkRollout(setup, options).rollout(problems)
    assert metrics["rethink_refine_solved"] == 1.0 and metrics["rethink_successes"] == 1.0  # 1 refine sample
    assert [p.uid for p in graded.problems] == ["1", "2", "3", "2"] and [len(g) for g in graded.groups] == [3, 3, 3, 1]
    hard, sft = graded.groups[1], graded.groups[3]
    assert all(c.behaviour == "policy" for g in graded.groups[:3] for c in g)  # no direct response replaced
    (success,) = sft
    assert success.behaviour == "rethink_sft" and success.prompt_ids == hard[0].prompt_ids == tuple(ord(c) for c in "Q: hard")
    assert success.off_policy is None and success.text == "y"
    assert graded.rewards.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    batch = collate(graded.groups, pad_token_id=0, current_version=0)
    assert batch.extras["sft_target"][:, 0].tolist() == [0.0] * 9 + [1.0]  # only verified successes are SFT targets
    advantages = grpo_advantage(graded.rewards, graded.group_index, batch.response_mask)
    assert advantages[:, 0].tolist() == [0.0] * 10  # all-equal direct groups and the group of one: A = 0


def test_the_sft_loss_is_ppo_clip_plus_lambda_times_the_cross_entropy_of_the_sft_tokens():
    """l_t = (1 - s_t) ppo_clip_t + lambda s_t (-log pi_t), and through seq_mean_token_mean the combined loss
    in closed form."""
    from rlbench.algorithm.aggregation import seq_mean_token_mean
    from rlbench.algorithm.losses.auxiliary_sft import ppo_clip_sft_loss

    logp = torch.tensor([[-0.5, -1.0], [-2.0, -0.25]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-0.7, -1.0], [-2.0, -0.25]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    sft = torch.tensor([[0.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
    loss, metrics = ppo_clip_sft_loss(logp, old, adv, mask, sft, clip_low=0.2, clip_high=0.2, sft_coef=0.25)
    ratio = math.exp(0.2)  # > 1.2: the clipped term binds on token (0, 0)
    assert loss[0].tolist() == pytest.approx([-min(ratio, 1.2), -1.0])  # -A min(rho, clip(rho)), A = 1
    assert loss[1].tolist() == pytest.approx([0.25 * 2.0, 0.25 * 0.25])  # lambda * (-log pi)
    total = seq_mean_token_mean(loss, mask, batch_sequences=2)
    assert total.item() == pytest.approx(((-1.2 - 1.0) / 2 + 0.25 * (2.0 + 0.25) / 2) / 2)
    total.backward()
    assert logp.grad[1].tolist() == pytest.approx([-0.25 / 2 / 2] * 2)  # d/dlogp of lambda (-logp) / T / B
    assert logp.grad[0, 0].item() == 0.0 and logp.grad[0, 1].item() == pytest.approx(-1 / 2 / 2)  # clipped; ratio 1
    assert metrics["sft_nll"] == pytest.approx((2.0 + 0.25) / 2) and metrics["sft_token_fraction"] == 0.5


class TwoOfThreeEngine(Engine):
    """As :class:`Engine`, but the refine prompt of "hard" is answered right by its 1st and 3rd samples only,
    "y" (log-prob -0.5) and "yy" (log-probs -1.0, -0.25); the 2nd answers "n"."""

    def generate(self, requests, params, generator=None):
        out = super().generate(requests, params, generator)
        for r, group in zip(requests, out):
            text = "".join(chr(t) for t in r.prompt_ids)
            if "hard" in text and "wrong" in text:
                group[1] = Completion(group[1].request_index, r.prompt_ids, [ord("n")], [-0.5], True, text="n")
                group[2] = Completion(group[2].request_index, r.prompt_ids, [ord("y"), ord("y")], [-1.0, -0.25], True, text="yy")
        return out


class YGrader:
    def __call__(self, text, answer, response_ids):
        ok = set(text) == {"y"}
        return Grade(correct=ok, extracted=text, reward=float(ok), format_ok=True)


def test_every_success_of_a_problem_is_trained_by_the_sft_term():
    """L_SFT = -sum over y in S1 u S2 of log pi(y | T_direct(x)) (arXiv:2510.15979, section 3): the refine stage
    answers "hard" right twice of 3 ("y", "yy"); both come back under the direct prompt as SFT targets in one
    group after the direct groups, and both enter the loss. With pi_theta = the sampling log-probs and lambda
    0.1, seq_mean_token_mean over the 3 x 3 direct responses (A = 0: no PPO term) and the 2 successes:
        L = (1 / 11) * 0.1 * [0.5 / 1 + (1.0 + 0.25) / 2] = 0.1 * 1.125 / 11
    Training the first success only (the earlier rule) gives 0.1 * 0.5 / 10."""
    from rlbench.algorithm.aggregation import seq_mean_token_mean
    from rlbench.algorithm.losses.auxiliary_sft import ppo_clip_sft_loss

    sampler = GroupSampler(TwoOfThreeEngine(), YGrader(), CharTokenizer(), {"user": "Q: {problem}"}, lambda r, _: r)
    setup = RolloutSetup(sampler, 3, SamplingParams(1.0, 1.0, 4), None)
    options = RethinkOptions(samples=3, shown_attempts=2, decompose_template="Split: {problem}",
                             refine_template="{problem} | {attempts} | wrong?", demonstrations=0)
    problems = [Problem("1", "easy", "y"), Problem("2", "hard", "y"), Problem("3", "never", "y")]
    graded, metrics = RethinkRollout(setup, options).rollout(problems)
    assert metrics["rethink_refine_solved"] == 1.0 and metrics["rethink_successes"] == 2.0
    assert [p.uid for p in graded.problems] == ["1", "2", "3", "2"] and [len(g) for g in graded.groups] == [3, 3, 3, 2]
    sft = graded.groups[3]
    assert [c.text for c in sft] == ["y", "yy"] and all(c.behaviour == "rethink_sft" for c in sft)
    assert all(c.prompt_ids == tuple(ord(ch) for ch in "Q: hard") for c in sft)  # both under the direct prompt
    batch = collate(graded.groups, pad_token_id=0, current_version=0)
    target = batch.extras["sft_target"] * batch.response_mask
    assert target.sum(-1).tolist() == [0.0] * 9 + [1.0, 2.0]
    logp = torch.zeros_like(batch.response_mask, dtype=torch.float64)
    logp[9, 0], logp[10, :2] = -0.5, torch.tensor([-1.0, -0.25])
    adv = torch.zeros_like(logp)  # every group all-correct or all-wrong, the SFT group too: A = 0
    loss, metrics = ppo_clip_sft_loss(logp, logp, adv, batch.response_mask.double(), batch.extras["sft_target"].double(),
                                      sft_coef=0.1)
    total = seq_mean_token_mean(loss, batch.response_mask.double(), batch_sequences=11)
    assert total.item() == pytest.approx(0.1 * (0.5 + (1.0 + 0.25) / 2) / 11)
    assert metrics["sft_nll"] == pytest.approx((0.5 + 1.0 + 0.25) / 3)


def test_stage_problem_substitutes_texts_with_braces():
    p = stage_problem(Problem("1", "f(x) = {x}", "1"), "A {problem} B {attempts}", "- \\boxed{2}")
    assert p.prompt == "A f(x) = {x} B - \\boxed{2}"


def test_settings_are_checked_before_the_model_loads(make_cfg):
    cfg = rollout_config(make_cfg("rollout=rethink").rollout)
    validate_strategy(cfg, "grpo")
    assert isinstance(make_strategy(cfg, RolloutSetup(None, 2, SamplingParams(), None)), RethinkRollout)
    base = {"strategy": "rethink", "n": 2}
    with pytest.raises(ConfigError, match="refine_template must contain"):
        validate_strategy(rollout_config({**base, "rethink": {"refine_template": "{problem}"}}), "grpo")
    with pytest.raises(ConfigError, match="decompose_template must contain"):
        validate_strategy(rollout_config({**base, "rethink": {"decompose_template": "solve"}}), "grpo")
    with pytest.raises(ConfigError, match="must be >= 1"):
        validate_strategy(rollout_config({**base, "rethink": {"samples": 0}}), "grpo")
    with pytest.raises(ConfigError, match="demonstrations must be >= 0"):
        validate_strategy(rollout_config({**base, "rethink": {"demonstrations": -1}}), "grpo")
    with pytest.raises(ConfigError, match="must contain {demonstrations}"):
        validate_strategy(rollout_config({**base, "rethink": {"decompose_template": "{problem}", "demonstrations": 1}}), "grpo")
    validate_strategy(rollout_config({**base, "rethink": {"decompose_template": "{problem}", "demonstrations": 0}}), "grpo")
    with pytest.raises(ConfigError, match="loss 'ppo_clip' has none: use algorithm/loss=ppo_clip_sft"):
        validate_config(make_cfg("rollout=rethink"))
    validate_config(make_cfg("rollout=rethink", "algorithm/loss=ppo_clip_sft"))
    validate_config(make_cfg("rollout=rethink", "rollout.rethink.successes=off_policy"))
    with pytest.raises(ConfigError, match="successes='rl'"):
        validate_strategy(rollout_config({**base, "rethink": {"successes": "rl"}}), "grpo")


def test_bm25_scores_a_three_document_example_in_closed_form():
    """Okapi BM25, k1 = 1.5, b = 0.75, idf(q) = ln((N - n(q) + 0.5) / (n(q) + 0.5) + 1), words lower-cased.
    Documents "a b", "A c, c", "d" (lengths 2, 3, 1; avgdl 2), query "a C": n(a) = 2, n(c) = 1, so
    idf(a) = ln(1.5 / 2.5 + 1) = ln 1.6 and idf(c) = ln(2.5 / 1.5 + 1) = ln(8 / 3).
    "a b": K = 1.5 (0.25 + 0.75 * 2 / 2) = 1.5; a: 1 * 2.5 / (1 + 1.5) = 1.
    "A c, c": K = 1.5 (0.25 + 0.75 * 3 / 2) = 2.0625; a: 2.5 / 3.0625 = 40 / 49; c: 2 * 2.5 / 4.0625 = 16 / 13.
    "d": shares no word, 0."""
    scores = bm25_scores("a C", ["a b", "A c, c", "d"])
    assert scores == pytest.approx([math.log(1.6), math.log(1.6) * 40 / 49 + math.log(8 / 3) * 16 / 13, 0.0], abs=1e-12)
    assert bm25_scores("a", []) == []


def test_top_k_is_best_first_ties_to_the_earlier_entry_and_never_a_zero_score():
    assert top_k([1.0, 2.0, 2.0, 0.0, 1.0], 3) == [1, 2, 0]
    assert top_k([1.0, 2.0, 2.0, 0.0, 1.0], 10) == [1, 2, 0, 4]  # the non-matching entry 3 is never shown
    assert top_k([0.5, 0.5], 1) == [0] and top_k([1.0], 0) == []


class DecomposeEngine(Engine):
    """Answers "y" when the problem (the prompt's last line) holds "easy", or "medium" under the decompose
    prompt ("Q: Split"); "n" otherwise (so demonstrations shown above the problem never change an answer)."""

    def generate(self, requests, params, generator=None):
        out = []
        for i, r in enumerate(requests):
            text = "".join(chr(t) for t in r.prompt_ids)
            self.prompts.append(text)
            problem = text.split("\n")[-1]
            ok = "easy" in problem or (text.startswith("Q: Split") and "medium" in problem)
            answer = "y" if ok else "n"
            out.append([Completion(i, r.prompt_ids, [ord(answer)], [-0.5], True, text=answer) for _ in range(r.n)])
        return out


STEPS = [
    [Problem("1", "easy one", "y"), Problem("2", "medium alpha", "y"), Problem("3", "never gamma", "y")],
    [Problem("5", "never Alpha beta", "y"), Problem("2", "medium alpha", "y")],
    [Problem("6", "never delta", "y"), Problem("7", "never beta", "y")],
]


def demo_strategy(k, template="Split: {demonstrations}{problem}"):
    sampler = GroupSampler(DecomposeEngine(), Grader(), CharTokenizer(), {"user": "Q: {problem}"}, lambda r, _: r)
    setup = RolloutSetup(sampler, 2, SamplingParams(1.0, 1.0, 4), None)
    options = RethinkOptions(samples=1, shown_attempts=1, decompose_template=template,
                             refine_template="{problem} | {attempts} | wrong?", demonstrations=k, buffer_size=8)
    return RethinkRollout(setup, options)


def run_steps(strategy, steps):
    """Each step's (decompose prompts, responses, rewards, metrics)."""
    out = []
    for problems in steps:
        start = len(strategy.setup.sampler.engine.prompts)
        graded, metrics = strategy.rollout(problems)
        prompts = [p for p in strategy.setup.sampler.engine.prompts[start:] if p.startswith("Q: Split")]
        out.append((prompts, [[c.response_ids for c in g] for g in graded.groups], graded.rewards.tolist(), metrics))
    return out


def test_a_successful_decomposition_is_buffered_and_shown_to_a_later_similar_problem():
    """Step 1: "medium alpha" is solved by its decomposition (buffered), "never gamma" is not (not buffered).
    Step 2: "never Alpha beta" shares "alpha" with it: its decompose prompt shows it; "medium alpha" itself is
    not shown its own past entry. Step 3: "never delta" and "never beta" share no word with the buffer (only
    decompose successes enter it, not step 2's failed "never Alpha beta"): plain prompts."""
    strategy = demo_strategy(2)
    (p1, _, _, m1), (p2, _, _, m2), (p3, _, _, m3) = run_steps(strategy, STEPS)
    assert p1 == ["Q: Split: medium alpha", "Q: Split: never gamma"]
    assert m1["rethink_decompose_solved"] == 1.0 and m1["rethink_buffer_size"] == 1.0
    assert p2 == ["Q: Split: Example problem:\nmedium alpha\nExample solution:\ny\n\nnever Alpha beta",
                  "Q: Split: medium alpha"]
    assert list(strategy.buffer) == [("2", "medium alpha", "y"), ("2", "medium alpha", "y")] and m2["rethink_buffer_size"] == 2
    assert p3 == ["Q: Split: never delta", "Q: Split: never beta"] and m3["rethink_buffer_size"] == 2


def test_demonstrations_are_ranked_by_bm25_ties_to_the_earlier_entry_and_the_buffer_is_fifo():
    strategy = demo_strategy(2)
    strategy.buffer.extend([("a", "x y", "r1"), ("b", "x", "r2"), ("c", "z", "r3"), ("d", "x y", "r4")])
    shown = strategy.demonstrations(Problem("q", "y x", "1"))
    # "x y" twice (tie: the earlier, r1, first), then "x"; "z" matches nothing
    assert shown == "".join(f"Example problem:\n{p}\nExample solution:\n{r}\n\n" for p, r in [("x y", "r1"), ("x y", "r4")])
    strategy.buffer.extend([("e", "w", "r")] * 7)  # capacity 8: the oldest three leave
    assert [uid for uid, _, _ in strategy.buffer] == ["d"] + ["e"] * 7


def test_k_zero_leaves_the_prompts_and_the_rollout_unchanged_bit_for_bit():
    """demonstrations = 0 with the {demonstrations} field gives exactly the run of the template without it
    (the field empty, no buffer, no state, no new metric)."""
    plain = demo_strategy(0, template="Split: {problem}")
    with_field = demo_strategy(0)
    assert run_steps(with_field, STEPS) == run_steps(plain, STEPS)
    assert with_field.setup.sampler.engine.prompts == plain.setup.sampler.engine.prompts
    assert not with_field.buffer and with_field.state_dict() is None


def test_a_resumed_run_shows_the_same_demonstrations_as_an_uninterrupted_one():
    whole = run_steps(demo_strategy(2), STEPS)
    first = demo_strategy(2)
    run_steps(first, STEPS[:1])
    saved = io.BytesIO()
    torch.save(first.state_dict(), saved)
    saved.seek(0)
    resumed = demo_strategy(2)
    resumed.load_state_dict(torch.load(saved, weights_only=True))  # as rlbench.training.checkpoint loads it
    assert run_steps(resumed, STEPS[1:]) == whole[1:]


@pytest.mark.slow
def test_cli_run_reports_its_stages(tmp_path):
    steps = smoke_cli_steps(tmp_path / "run", "rollout=rethink", "algorithm/loss=ppo_clip_sft", "rollout.rethink.samples=2")
    assert all("rethink_zero_accuracy_prompts" in s for s in steps)
