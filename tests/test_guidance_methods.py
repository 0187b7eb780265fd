"""The guided presets edit_grpo, dagrpo and otr: their rollouts, advantages and losses in closed form."""

import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_guidance import CharTokenizer  # noqa: E402

from rlbench.config.typed import rollout_config
from rlbench.dataset.base import Problem  # noqa: E402
from rlbench.errors import ConfigError  # noqa: E402
from rlbench.guidance import GuidanceLibrary, Trace  # noqa: E402
from rlbench.reward import MathReward  # noqa: E402
from rlbench.reward.toy import EvenTokenReward  # noqa: E402
from rlbench.rollout import GroupSampler, RolloutSetup, make_strategy, validate_strategy  # noqa: E402
from rlbench.rollout.engines.base import Completion, SamplingParams  # noqa: E402
from rlbench.rollout.guided.edit_injection import edited_response, numbers_in, sentence_spans  # noqa: E402

TOK = CharTokenizer()
REFERENCE = "He has 3 + 4 = 7 apples.\nThen 7 * 2 = 14.\nThe final answer is \\boxed{14}."
PROBLEM = Problem("0", "Tom has 3 and 4 apples, doubled. How many?", "14")


def reference_trace(text=REFERENCE, uid="0"):
    return Trace(uid, text, tuple(TOK.encode(text)) + (0,), "dataset")


def sampled(text, logprob=-0.5):
    ids = TOK.encode(text)
    return Completion(0, (1,), ids, [logprob] * len(ids), True, text=text)


# ----------------------------------------------------------------------------------------- edit_grpo


def test_sentences_and_numbers_of_a_response():
    pieces = list("a 1.5 b. c\nd")
    spans = sentence_spans(pieces)
    assert ["".join(pieces[s:e]) for s, e in spans] == ["a 1.5 b.", " c\n", "d"]  # "1.5" does not end a sentence
    assert numbers_in("1,072 apples, 12.0 and -3.5") == {"1072", "12", "-3.5"}


def test_the_first_wrong_sentence_is_replaced_by_the_aligned_reference_step_and_the_remainder():
    response = "He has 3 + 4 = 7 apples.\nThen 7 * 2 = 15.\nThe answer is 15."
    edited = edited_response(sampled(response), reference_trace(), PROBLEM, "numbers", TOK, 200)
    kept = "He has 3 + 4 = 7 apples.\n"
    assert edited.text == kept + "Then 7 * 2 = 14.\nThe final answer is \\boxed{14}."
    assert edited.response_ids[-1] == 0 and edited.finished and edited.behaviour == "edited"
    # exactly the edited span is off-policy; the kept tokens keep their sampling log-probs, the edit has mu = 1
    tail = len(edited.response_ids) - len(kept)
    assert edited.off_policy == [0] * len(kept) + [1] * tail
    assert edited.behaviour_logprobs == [-0.5] * len(kept) + [0.0] * tail
    assert MathReward()(edited.text, "14", edited.response_ids).correct  # the edited trajectory passes the verifier
    # a response whose every step checks out keeps them all and gets the reference's steps after them
    partial = edited_response(sampled("He has 3 + 4 = 7 apples.\n"), reference_trace(), PROBLEM, "numbers", TOK, 200)
    assert partial.text == REFERENCE and partial.off_policy.count(0) == len("He has 3 + 4 = 7 apples.\n")
    # ... and a response that ended (EOS) keeps its steps but not its EOS
    ended = Completion(0, (1,), TOK.encode("He has 3 + 4 = 7 apples.\n") + [0], [-0.5] * 26, True)
    assert edited_response(ended, reference_trace(), PROBLEM, "numbers", TOK, 200).response_ids == list(reference_trace().token_ids)
    # a budget cuts the edit (the response is then unfinished)
    cut = edited_response(sampled(response), reference_trace(), PROBLEM, "numbers", TOK, len(kept) + 4)
    assert cut.text == kept + "Then" and not cut.finished and sum(cut.off_policy) == 4


def test_the_toy_checker_replaces_from_the_first_odd_token():
    trace = Trace("0", "", (2, 4, 6, 8), "dataset", finished=False)
    edited = edited_response(Completion(0, (1,), [2, 4, 5, 7], [-1.0] * 4, False), trace, PROBLEM, "even_tokens", TOK, 4)
    assert edited.response_ids == [2, 4, 6, 8] and edited.off_policy == [0, 0, 1, 1]
    assert edited.behaviour_logprobs == [-1.0, -1.0, 0.0, 0.0] and not edited.finished


class TextEngine:
    """Every request gets the responses ``texts`` in turn (n of them)."""

    def __init__(self, texts):
        self.texts, self.requests = texts, []

    def generate(self, requests, params, generator=None):
        self.requests.append([(r.prompt_ids, r.n, r.prefix_ids) for r in requests])
        return [[sampled(self.texts[k % len(self.texts)]) for k in range(r.n)] for r in requests]


def edit_setup(library, texts, n=4):
    class Sampler(GroupSampler):
        def encode(self, problems):
            return [(int(p.uid),) for p in problems]

    sampler = Sampler(TextEngine(texts), MathReward(), TOK, {}, lambda r, _: r)
    return RolloutSetup(sampler, n, SamplingParams(1.0, 1.0, 200), None, guidance=library)


EDIT_CFG = {"strategy": "edit_injection", "n": 4, "edit_injection": {"edits_per_group": 1, "checker": "numbers"}}
WRONG, RIGHT = "He has 3 + 4 = 8 apples.", "3 + 4 = 7, 7 * 2 = 14. The final answer is \\boxed{14}."


def test_one_wrong_response_per_group_is_edited_and_the_group_holds_both_origins():
    library = GuidanceLibrary()
    library.add(reference_trace())
    setup = edit_setup(library, [RIGHT, WRONG, WRONG, RIGHT])
    graded, metrics = make_strategy(rollout_config(EDIT_CFG), setup).rollout([PROBLEM, Problem("1", "q", "14")])
    first, second = graded.groups
    assert [c.behaviour for c in first] == ["policy", "edited", "policy", "policy"]  # only the first wrong one
    assert first[1].text == REFERENCE  # its first sentence was wrong: the whole reference from step 0
    assert [c.behaviour for c in second] == ["policy"] * 4  # no reference for this prompt: left alone
    assert graded.outcome.tolist() == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0] and metrics["edited_correct"] == 1.0
    assert metrics["rollout_outcome_mean"] == 0.5 and metrics["edited_responses"] == 1.0  # before the edit


def test_without_references_edit_injection_is_iid_exactly():
    problems = [PROBLEM, Problem("1", "q", "14")]
    edit, iid = edit_setup(GuidanceLibrary(), [WRONG, RIGHT]), edit_setup(None, [WRONG, RIGHT])
    graded, _ = make_strategy(rollout_config(EDIT_CFG), edit).rollout(problems)
    base, _ = make_strategy(rollout_config({"strategy": "iid", "n": 4}), iid).rollout(problems)
    assert edit.sampler.engine.requests == iid.sampler.engine.requests
    assert graded.groups == base.groups and torch.equal(graded.rewards, base.rewards)


def test_edit_injection_refuses_bad_settings():
    with pytest.raises(ConfigError, match="edits_per_group=5 must lie in 1..rollout.n=4"):
        validate_strategy(rollout_config({**EDIT_CFG, "edit_injection": {"edits_per_group": 5}}), "grpo")
    with pytest.raises(ConfigError, match="checker='llm' is unknown"):
        validate_strategy(rollout_config({**EDIT_CFG, "edit_injection": {"checker": "llm"}}), "grpo")


# ----------------------------------------------------------------------------------------- dagrpo

from rlbench.algorithm.advantages.group_relative import distinct_pair_mask, distinct_pairs_advantage  # noqa: E402


def test_distinct_pairs_mask_and_advantage_in_closed_form():
    scores = torch.tensor([1.0, 0.95, 0.0, 0.5, 0.3, 0.3])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    mask = distinct_pair_mask(scores, groups, 0.1)
    assert torch.equal(mask, mask.T) and not mask.diagonal().any()
    assert mask[0].tolist() == [False, False, True, True, False, False]  # 1.0 vs 0.95: too close; other group: never
    std = torch.tensor([1.0, 0.95, 0.0, 0.5], dtype=torch.float64).std().item()
    advantage = distinct_pairs_advantage(scores, groups, torch.ones(6, 2), delta=0.1, epsilon=0.0)[:, 0]
    expected = [0.75 / std, 0.7 / std, -2.45 / 3 / std, -0.15 / std, 0.0, 0.0]  # identical scores: 0
    assert advantage.tolist() == pytest.approx(expected, rel=1e-6)
    # every pair too close: no gradient at all (GRPO would still push 1.0 up and 0.95 down)
    assert distinct_pairs_advantage(torch.tensor([1.0, 0.95]), torch.tensor([0, 0]), torch.ones(2, 1)).abs().sum() == 0
    with pytest.raises(ConfigError, match="delta must be >= 0"):
        distinct_pairs_advantage(scores, groups, torch.ones(6, 1), delta=-1.0)


def test_an_all_wrong_group_gets_an_anchor_and_with_it_a_nonzero_advantage():
    library = GuidanceLibrary()
    for uid in ("0", "1"):
        library.add(Trace(uid, "", (2, 4, 6, 8), "dataset"))

    class Engine:  # prompt 0: odd tokens (toy reward 0, wrong); prompt 1: even tokens (right)
        requests = []

        def generate(self, requests, params, generator=None):
            self.requests.append([(r.prompt_ids, r.n) for r in requests])
            return [[Completion(i, r.prompt_ids, [1, 3] if r.prompt_ids == (0,) else [2, 4], [-0.1, -0.1], True)
                     for _ in range(r.n)] for i, r in enumerate(requests)]

    class Sampler(GroupSampler):
        def encode(self, problems):
            return [(int(p.uid),) for p in problems]

    setup = RolloutSetup(Sampler(Engine(), EvenTokenReward(), TOK, {}, lambda r, _: r), 3, SamplingParams(1.0, 1.0, 4), None, guidance=library)
    cfg = {"strategy": "mixed_traces", "n": 3, "mixed_traces": {"traces_per_group": 1, "when": "unsolved"}}
    graded, metrics = make_strategy(rollout_config(cfg), setup).rollout([Problem("0", "q", "a"), Problem("1", "q", "a")])
    assert setup.sampler.engine.requests == [[((0,), 3), ((1,), 3)]]  # the iid requests: n samples each
    assert [c.behaviour for c in graded.groups[0]] == ["policy"] * 3 + ["dataset"]
    assert [c.behaviour for c in graded.groups[1]] == ["policy"] * 3  # solved: no anchor
    assert metrics == {"rollout_outcome_mean": 0.5, "groups_anchored": 1.0}
    advantage = distinct_pairs_advantage(graded.rewards, graded.group_index, torch.ones(7, 1))[:, 0]
    # each wrong response pairs with the anchor only: -1 / std, std of [0, 0, 0, 1] = 0.5; the anchor +1 / std
    assert advantage[:4].tolist() == pytest.approx([-2.0] * 3 + [2.0], rel=1e-5)
    assert advantage[4:].abs().sum() == 0
    with pytest.raises(ConfigError, match="when='sometimes' is unknown"):
        validate_strategy(rollout_config({**cfg, "mixed_traces": {"when": "sometimes"}}), "grpo")
    validate_strategy(rollout_config({**cfg, "mixed_traces": {"traces_per_group": 3, "when": "unsolved"}}), "grpo")


def test_without_anchors_the_anchor_rollout_is_iid_exactly():
    problems = [PROBLEM, Problem("1", "q", "14")]
    anchors, iid = edit_setup(GuidanceLibrary(), [WRONG, RIGHT]), edit_setup(None, [WRONG, RIGHT])
    cfg = {"strategy": "mixed_traces", "n": 4, "mixed_traces": {"when": "unsolved"}}
    graded, _ = make_strategy(rollout_config(cfg), anchors).rollout(problems)
    base, _ = make_strategy(rollout_config({"strategy": "iid", "n": 4}), iid).rollout(problems)
    assert anchors.sampler.engine.requests == iid.sampler.engine.requests
    assert graded.groups == base.groups and torch.equal(graded.rewards, base.rewards)


# ----------------------------------------------------------------------------------------- otr

from conftest import algorithm_from  # noqa: E402
from rlbench.algorithm.losses.token_rollout import otr_loss  # noqa: E402
from rlbench.errors import DataError  # noqa: E402


def otr_gradient(logits, target, positions, **params):
    """d/d logits of the mean OTR loss over ``positions`` positions that share one distribution."""
    z = logits.clone().requires_grad_(True)
    log_probs = torch.log_softmax(z, -1).expand(1, positions, -1)
    ids = torch.full((1, positions), target)
    loss, metrics = otr_loss(log_probs, ids, torch.ones(1, positions), **params)
    loss.mean().backward()
    return z.grad, metrics


def test_otr_gradient_in_expectation_is_sft_weighted_by_the_reference_probability():
    logits, target = torch.tensor([0.5, -1.0, 1.0, 0.0, -0.5], dtype=torch.float64), 2
    pi = torch.softmax(logits, -1)
    sft_direction = torch.nn.functional.one_hot(torch.tensor(target), 5).double() - pi  # grad of log pi(y*)
    expected = -pi[target] * sft_direction  # the gradient of the loss (minus the ascent direction)
    grad, metrics = otr_gradient(logits, target, 40000, samples=4, baseline=False)
    assert torch.allclose(grad, expected, atol=4e-3)
    assert metrics["token_rollout_match"] == pytest.approx(pi[target].item(), abs=5e-3)
    assert metrics["reference_prob_mean"] == pytest.approx(pi[target].item())
    # the leave-in mean baseline: (K - 1) / K of it
    grad, _ = otr_gradient(logits, target, 40000, samples=4, baseline=True)
    assert torch.allclose(grad, 0.75 * expected, atol=4e-3)
    # a mismatch reward of -1 adds -(-1) * E[(1 - r) grad log pi(a)] = -pi(y*) * grad log pi(y*) once more
    grad, _ = otr_gradient(logits, target, 40000, samples=4, baseline=False, mismatch_reward=-1.0)
    assert torch.allclose(grad, 2 * expected, atol=6e-3)


def test_otr_gradient_is_zero_when_the_policy_already_says_the_reference():
    logits = torch.tensor([0.0, 80.0, 0.0], dtype=torch.float64)
    grad, metrics = otr_gradient(logits, 1, 16, samples=8)
    assert metrics["token_rollout_match"] == 1.0 and torch.equal(grad, torch.zeros(3, dtype=torch.float64))


def test_otr_samples_are_repeatable_and_only_its_loss_keeps_the_vocabulary():
    log_probs = torch.log_softmax(torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(0)), -1)
    ids, mask = torch.tensor([[1, 2, 3], [4, 5, 0]]), torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    first, _ = otr_loss(log_probs, ids, mask, progress=0.5)
    again, _ = otr_loss(log_probs, ids, mask, progress=0.5)
    assert torch.equal(first, again) and first[1, 2] == 0  # padding carries no loss
    otr = algorithm_from(OmegaConf.create({"name": "otr", "advantage": {"name": "dr_grpo"}, "loss": {"name": "otr"},
                                                  "aggregation": {"name": "token_mean"}}))
    grpo = algorithm_from(OmegaConf.create({"name": "grpo", "advantage": {"name": "grpo"}, "loss": {"name": "ppo_clip"},
                                                   "aggregation": {"name": "token_mean"}}))
    assert otr.needs_vocabulary_log_probs and not grpo.needs_vocabulary_log_probs


class NoEngine:
    def generate(self, requests, params, generator=None):
        raise AssertionError("rollout=references generates nothing for training")


def test_references_are_the_groups_and_nothing_is_generated():
    library = GuidanceLibrary()
    library.add(reference_trace())
    setup = edit_setup(library, [RIGHT])
    setup.sampler.engine = NoEngine()
    strategy = make_strategy(rollout_config({"strategy": "references", "n": 4}), setup)
    graded, metrics = strategy.rollout([PROBLEM, Problem("1", "q", "14")])
    assert [[c.behaviour for c in g] for g in graded.groups] == [["dataset"]]  # the prompt without a reference is left out
    assert graded.groups[0][0].off_policy == [1] * len(reference_trace().token_ids) and metrics == {"groups_with_trace": 1.0}
    with pytest.raises(DataError, match="none of the step's 1 prompts has a guidance trace"):
        strategy.rollout([Problem("1", "q", "14")])
    with pytest.raises(ConfigError, match="monitor_n must be >= 0"):
        validate_strategy(rollout_config({"strategy": "references", "n": 4, "references": {"monitor_n": -1}}), "grpo")
