"""Guidance: trace sources and their bad input, LUFFY's mixed groups and its policy-shaping loss."""

import json
import math

import pytest
import torch

from rlbench.config.schema import DatasetConfig, GuidanceConfig
from rlbench.config.typed import rollout_config
from rlbench.algorithm.losses import ppo_clip_loss
from rlbench.algorithm.losses.off_policy import policy_shaping_loss, shaping_gamma
from rlbench.dataset.arith import derivation
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError, DataError
from rlbench.guidance import GuidanceLibrary, GuidanceOptions, Trace, load_guidance, trace_completion
from rlbench.utils import tokenizer_fingerprint
from rlbench.guidance.traces import even_token_ids, solution_trace_text
from rlbench.reward import MathReward
from rlbench.reward.toy import EvenTokenReward
from rlbench.rollout import GroupSampler, RolloutSetup, make_strategy, validate_strategy
from rlbench.rollout.engines.base import Completion, SamplingParams
from rlbench.rollout.guided.mixed_traces import MixedTraces
from rlbench.training.batch import collate
from rlbench.training.step import behaviour_old_logp


class CharTokenizer:
    """One token per character (id = code point), EOS 0."""

    eos_token_id = 0
    all_special_ids = [0]

    def __init__(self, shift=0):
        self.shift = shift

    def encode(self, text, add_special_tokens=False):
        return [ord(c) + self.shift for c in text]

    def decode(self, ids):
        return "".join(chr(i - self.shift) for i in ids if i)

    def get_vocab(self):
        return {chr(i): i + self.shift for i in range(1, 300)}

    def __len__(self):
        return 300


def arith(uid, expression, answer):
    return Problem(uid, expression, answer)


# ----------------------------------------------------------------------------------------- sources


def test_dataset_solutions_become_responses():
    gsm8k = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 48+24 = <<48+24=72>>72.\n#### 1,072"
    assert solution_trace_text(gsm8k) == (
        "Natalia sold 48/2 = 24 clips in May.\nShe sold 48+24 = 72.\nThe final answer is \\boxed{1072}."
    )
    math_solution = "So $x = \\boxed{\\frac12}$."
    assert solution_trace_text(math_solution) == math_solution
    assert derivation("2 + 3 * 4") == "2 + 3 * 4 = 2 + 12 = 14"
    assert derivation("2 * 3 - 4 * 5") == "2 * 3 - 4 * 5 = 6 - 4 * 5 = 6 - 20 = -14"
    assert derivation("37 + 48") == "37 + 48 = 85"


def test_arith_derivations_are_graded_correct_and_carry_eos():
    problems = [arith("a/0", "2 + 3 * 4", "14"), arith("a/1", "7 + 8", "15")]
    library = load_guidance(GuidanceOptions("dataset"), problems, CharTokenizer(), MathReward(extraction="last_number"), 64, DatasetConfig(loader="arith"))
    assert library.counts == {"kept": 2, "unknown_uid": 0, "empty": 0, "too_long": 0, "tokenizer_mismatch": 0, "incorrect": 0}
    trace = library.for_problem(problems[0])[0]
    assert trace.text == "2 + 3 * 4 = 2 + 12 = 14" and trace.token_ids[-1] == 0 and trace.finished
    assert trace.behaviour == "dataset" and trace.correct


def write_traces(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def bad_trace_file(tmp_path):
    tok = CharTokenizer()
    return write_traces(tmp_path / "traces.jsonl", [
        {"uid": "a/0", "text": "2 + 3 = 5"},                                # kept
        {"uid": "a/9", "text": "1 + 1 = 2"},                                # unknown uid
        {"uid": "a/1", "text": "   "},                                      # empty
        {"uid": "a/1", "text": "7 + 8 = 16"},                               # graded wrong
        {"uid": "a/1", "text": "7 + 8 = " + "1" * 80 + " 15"},              # too long (limit 32)
        {"uid": "a/1", "response_ids": [55, 32, 43], "tokenizer": "elsewhere"},       # another tokenizer
        {"uid": "a/1", "response_ids": tok.encode("15"), "tokenizer": tokenizer_fingerprint(tok)},  # same: kept
    ])


def test_bad_traces_are_counted_and_left_out(tmp_path, caplog):
    problems = [arith("a/0", "2 + 3", "5"), arith("a/1", "7 + 8", "15")]
    options = GuidanceOptions("jsonl", path=bad_trace_file(tmp_path))
    library = load_guidance(options, problems, CharTokenizer(), MathReward(extraction="last_number"), 32)
    assert library.counts == {"kept": 2, "unknown_uid": 1, "empty": 1, "too_long": 1, "tokenizer_mismatch": 1, "incorrect": 1}
    assert [t.text for t in library.for_problem(problems[1])] == ["15"]
    assert library.for_problem(problems[0])[0].behaviour == "teacher"
    assert "left out unknown_uid 1" in caplog.text and "traces.jsonl:2" in caplog.text


def test_wrong_traces_are_kept_only_when_asked_and_stop_refuses_before_training(tmp_path):
    problems = [arith("a/0", "2 + 3", "5"), arith("a/1", "7 + 8", "15")]
    path = write_traces(tmp_path / "t.jsonl", [{"uid": "a/1", "text": "7 + 8 = 16"}])
    kept = load_guidance(GuidanceOptions("jsonl", path=path, keep_incorrect=True), problems, CharTokenizer(), MathReward(extraction="last_number"), 32)
    assert len(kept) == 1 and not kept.for_problem(problems[1])[0].correct
    with pytest.raises(DataError, match=r"incorrect 1 \(e.g. .*t.jsonl:1\) of 1 traces.*guidance.on_bad=skip"):
        load_guidance(GuidanceOptions("jsonl", path=path, on_bad="stop"), problems, CharTokenizer(), MathReward(extraction="last_number"), 32)


def test_guidance_options_refuse_bad_settings(tmp_path):
    with pytest.raises(ConfigError, match="guidance.path"):
        GuidanceOptions.from_config(GuidanceConfig(source="jsonl"))
    with pytest.raises(DataError, match="no such file"):
        GuidanceOptions.from_config(GuidanceConfig(source="jsonl", path=str(tmp_path / "missing.jsonl")))
    with pytest.raises(ConfigError, match="on_bad"):
        GuidanceOptions.from_config(GuidanceConfig(source="dataset", on_bad="ignore"))
    bad = write_traces(tmp_path / "bad.jsonl", [{"text": "no uid"}])
    with pytest.raises(DataError, match="bad.jsonl:1: a trace record needs a string 'uid'"):
        load_guidance(GuidanceOptions("jsonl", path=bad), [], CharTokenizer(), MathReward(), 8)


def test_toy_traces_are_even_deterministic_and_earn_the_full_toy_reward():
    tok = CharTokenizer()
    ids = even_token_ids(tok, 8, "arith/train/3", seed=0)
    assert len(ids) == 8 and all(t % 2 == 0 and t != 0 for t in ids)
    assert ids == even_token_ids(tok, 8, "arith/train/3", seed=0) != even_token_ids(tok, 8, "arith/train/4", seed=0)
    library = load_guidance(GuidanceOptions("even_tokens"), [arith("arith/train/3", "1 + 1", "2")], tok, EvenTokenReward(), 8)
    trace = library.for_problem(arith("arith/train/3", "", ""))[0]
    assert trace.token_ids == ids and trace.reward == 1.0 and not trace.finished


# ----------------------------------------------------------------------------------------- the trace in the batch


def test_a_trace_is_off_policy_in_every_token_with_mu_one():
    c = trace_completion(Trace("u", "ab", (5, 6, 0), "teacher"), (1, 2))
    assert c.behaviour == "teacher" and c.off_policy == [1, 1, 1] and c.behaviour_logprobs == [0.0, 0.0, 0.0]
    batch = collate([[Completion(0, (1, 2), (3, 4, 5), [-0.5, -0.5, -0.5], True), c]], 0, current_version=0)
    recomputed = torch.full((2, 3), -2.0)
    # the policy's own tokens keep the recomputed pi_old; the trace's get log mu = 0, never the recomputed one
    assert behaviour_old_logp(batch, recomputed).tolist() == [[-2.0, -2.0, -2.0], [0.0, 0.0, 0.0]]


# ----------------------------------------------------------------------------------------- policy shaping


def test_shaped_gradient_is_the_closed_form_and_peaks_at_gamma():
    gamma = 0.1
    probs = torch.tensor([[0.01, 0.1, 0.5, 0.9]], dtype=torch.float64)
    logp = probs.log().requires_grad_(True)
    advantages = torch.full_like(probs, 2.0)
    loss, _ = policy_shaping_loss(logp, torch.zeros_like(probs), advantages, torch.ones_like(probs), torch.ones_like(probs), gamma=gamma)
    assert torch.allclose(loss.detach(), -2.0 * probs / (probs + gamma))
    loss.sum().backward()
    expected = -2.0 * gamma * probs / (probs + gamma) ** 2  # d(-A f(pi)) / d log pi
    assert torch.allclose(logp.grad, expected)
    weight = (-logp.grad / 2.0)[0]
    assert weight[1] > weight[0] and weight[1] > weight[3]  # the weight gamma p / (p + gamma)^2 peaks at p = gamma


def test_a_trace_token_is_never_clipped_while_the_policy_tokens_are():
    logp = torch.tensor([[math.log(3.0), math.log(3.0)]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 2, dtype=torch.float64)  # ratio 3 on both tokens
    off = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    loss, metrics = policy_shaping_loss(logp, old, torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64), off)
    loss.sum().backward()
    assert logp.grad[0, 0] < 0 and logp.grad[0, 1] == 0  # the trace token has a gradient, the clipped policy token none
    assert metrics["clip_fraction"] == 1.0 and metrics["off_policy_fraction"] == 0.5


def test_without_off_policy_tokens_policy_shaping_is_ppo_clip_exactly():
    torch.manual_seed(0)
    logp, old, adv = torch.randn(3, 5), torch.randn(3, 5), torch.randn(3, 5)
    mask = (torch.rand(3, 5) > 0.2).float()
    shaped, _ = policy_shaping_loss(logp, old, adv, mask, torch.zeros(3, 5), clip_low=0.2, clip_high=0.28)
    plain, _ = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    assert torch.equal(shaped, plain)


def test_guide_gamma_is_the_percentile_of_the_off_policy_ratios_only():
    ratio = torch.tensor([[0.5, 1.0, 2.0, 100.0]])
    off = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert shaping_gamma(ratio, off, None, 0.5).item() == pytest.approx(1.0)
    assert shaping_gamma(torch.full((1, 2), 1e-9), torch.ones(1, 2), None, 0.9).item() == pytest.approx(1e-4)
    logp = torch.log(ratio)
    loss, metrics = policy_shaping_loss(logp, torch.zeros_like(logp), torch.ones_like(logp), torch.ones_like(logp), off, gamma_quantile=0.5)
    assert torch.allclose(loss[0, :3], -ratio[0, :3] / (ratio[0, :3] + 1.0))
    assert metrics["shaping_gamma"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="gamma_quantile must lie in"):
        policy_shaping_loss(logp, logp, logp, logp, off, gamma_quantile=1.5)


# ----------------------------------------------------------------------------------------- mixed groups


class ScriptedEngine:
    def __init__(self):
        self.requests = []

    def generate(self, requests, params, generator=None):
        self.requests.append([(r.prompt_ids, r.n) for r in requests])
        return [[Completion(i, r.prompt_ids, [1, 3], [-0.1, -0.1], True) for _ in range(r.n)] for i, r in enumerate(requests)]


def mixed_setup(library, n=4):
    class Sampler(GroupSampler):
        def encode(self, problems):
            return [(int(p.uid),) for p in problems]

    sampler = Sampler(ScriptedEngine(), EvenTokenReward(threshold=0.75), CharTokenizer(), {}, lambda r, _: r)
    return RolloutSetup(sampler, n, SamplingParams(1.0, 1.0, 4), None, guidance=library)


def test_a_group_holds_n_minus_k_policy_samples_and_k_traces_used_in_turn():
    library = GuidanceLibrary()
    for ids in ((2, 4), (6, 8)):
        library.add(Trace("0", "", ids, "dataset"))
    setup = mixed_setup(library)
    strategy = make_strategy(rollout_config({"strategy": "mixed_traces", "n": 4, "mixed_traces": {"traces_per_group": 1}}), setup)
    assert isinstance(strategy, MixedTraces)
    graded, metrics = strategy.rollout([Problem("0", "q", "a"), Problem("1", "q", "a")])
    assert setup.sampler.engine.requests == [[((0,), 3), ((1,), 4)]]  # a prompt without a trace gets n samples
    assert [len(g) for g in graded.groups] == [4, 4]
    assert metrics == {"groups_with_trace": 1.0, "rollout_outcome_mean": 0.0}  # the policy's own responses only
    assert [c.behaviour for c in graded.groups[0]] == ["policy"] * 3 + ["dataset"]
    assert graded.rewards.tolist() == [0.0, 0.0, 0.0, 1.0] + [0.0] * 4  # the trace is graded with its group
    second, _ = strategy.rollout([Problem("0", "q", "a")])
    assert second.groups[0][-1].response_ids == (6, 8)  # the next trace of the prompt
    restored = MixedTraces(setup, 1)
    restored.load_state_dict(strategy.state_dict())
    assert restored.pick_traces(Problem("0", "q", "a"))[0].token_ids == (2, 4)


def test_without_traces_the_requests_are_the_iid_ones():
    mixed = mixed_setup(GuidanceLibrary())
    iid = mixed_setup(None)
    problems = [Problem("0", "q", "a"), Problem("1", "q", "a")]
    make_strategy(rollout_config({"strategy": "mixed_traces", "n": 4}), mixed).rollout(problems)
    make_strategy(rollout_config({"strategy": "iid", "n": 4}), iid).rollout(problems)
    assert mixed.sampler.engine.requests == iid.sampler.engine.requests


def test_traces_per_group_must_leave_room_for_the_policy():
    with pytest.raises(ConfigError, match="traces_per_group=4 must be at least 1 and below rollout.n=4"):
        validate_strategy(rollout_config({"strategy": "mixed_traces", "n": 4, "mixed_traces": {"traces_per_group": 4}}), "grpo")
    with pytest.raises(ConfigError, match="has no key"):
        validate_strategy(rollout_config({"strategy": "mixed_traces", "n": 4, "mixed_traces": {"per_group": 1}}), "grpo")


# ----------------------------------------------------------------------------------------- hints and prefixes

from rlbench.rollout.guided.guided_prefix import GuidanceLength, GuidedPrefix  # noqa: E402
from rlbench.rollout.guided.hint_reroll import HintReroll  # noqa: E402
from rlbench.rollout.guided.hints import HINT_SEPARATOR, hint_text  # noqa: E402
from rlbench.rollout.guided.scaf_hints import ScafHints  # noqa: E402


class HintEngine:
    """Prompt (k,) answers odd tokens (reward 0); a hinted prompt (1000 + k,) even ones (reward 1) when its
    hint reveals at least ``needed`` words; prefix requests return the prefix then [2]."""

    def __init__(self):
        self.requests = []

    def generate(self, requests, params, generator=None):
        self.requests.append([(r.prompt_ids, r.n, r.prefix_ids) for r in requests])
        out = []
        for i, r in enumerate(requests):
            tokens = [2, 4] if r.prompt_ids[0] >= 1000 else [1, 3]
            ids = list(r.prefix_ids) + ([2] if r.prefix_ids else tokens)
            lp = [-0.5] * len(ids)
            out.append([Completion(i, r.prompt_ids, ids, lp, True, prefix_len=len(r.prefix_ids)) for _ in range(r.n)])
        return out


def hint_setup(library, n=4, needed_words=0):
    class Sampler(GroupSampler):
        def encode(self, problems):
            ids = []
            for p in problems:
                base = int(p.uid)
                hinted = HINT_SEPARATOR in p.prompt and len(p.prompt.split(HINT_SEPARATOR)[1].split()) >= needed_words
                ids.append((1000 + base,) if hinted else (base,))
            return ids

    sampler = Sampler(HintEngine(), EvenTokenReward(threshold=0.75), CharTokenizer(), {}, lambda r, _: r)
    return RolloutSetup(sampler, n, SamplingParams(1.0, 1.0, 4), None, guidance=library)


def library_of(**texts):
    library = GuidanceLibrary()
    for uid, text in texts.items():
        library.add(Trace(uid, text, (2, 4, 6, 0), "dataset"))
    return library


def test_hint_is_a_share_of_the_solution_words():
    assert hint_text("a b c d", 0.5) == "a b" and hint_text("a b c d", 0.3) == "a b" and hint_text("a b c d", 1.0) == "a b c d"


def test_guide_rerolls_only_all_wrong_groups_and_trains_hinted_responses_for_the_unhinted_prompt():
    setup = hint_setup(library_of(**{"0": "w1 w2 w3 w4", "1": "v1 v2"}))
    strategy = make_strategy(rollout_config({"strategy": "hint_reroll", "n": 4, "hint_reroll": {"hint_share": 0.5}}), setup)
    assert isinstance(strategy, HintReroll)
    graded, metrics = strategy.rollout([Problem("0", "q", "a"), Problem("1", "q", "a")])
    # both groups are all wrong: both re-rolled with the hint, both solved
    assert setup.sampler.engine.requests[1] == [((1000,), 4, ()), ((1001,), 4, ())]
    assert metrics == {"rollout_outcome_mean": 0.0, "groups_unsolved_with_trace": 2.0, "groups_hinted": 2.0}
    assert graded.group_ids == [0, 1] and graded.rewards.tolist() == [1.0] * 8
    hinted = graded.groups[0][0]
    assert hinted.prompt_ids == (0,) and hinted.behaviour == "hint"  # trained for the prompt without the hint
    assert hinted.off_policy == [1, 1] and hinted.behaviour_logprobs == [-0.5, -0.5]  # log pi_old(y | x, h)


def test_guide_leaves_solved_groups_and_prompts_without_a_trace_alone():
    setup = hint_setup(library_of(**{"1": "v1 v2"}))
    strategy = HintReroll(setup, 0.5)
    graded, metrics = strategy.rollout([Problem("0", "q", "a")])  # no trace for "0"
    assert len(setup.sampler.engine.requests) == 1 and metrics["groups_hinted"] == 0.0
    assert all(c.behaviour == "policy" for c in graded.groups[0])


def test_guide_ratio_is_pi_without_the_hint_over_pi_old_with_it():
    # the stored behaviour log-prob (hinted prompt) is pi_old; the trainer's log-prob is for the unhinted prompt
    hinted = Completion(0, (7,), (2, 4), [-1.0, -2.0], True, behaviour="hint", off_policy=[1, 1], behaviour_logprobs=[-1.0, -2.0])
    batch = collate([[hinted]], 0, current_version=0)
    unhinted_logp = torch.tensor([[-1.5, -2.0]], dtype=torch.float64)
    old = behaviour_old_logp(batch, torch.zeros(1, 2, dtype=torch.float64))
    assert old.tolist() == [[-1.0, -2.0]]
    loss, _ = policy_shaping_loss(unhinted_logp, old, torch.ones(1, 2, dtype=torch.float64), batch.response_mask.double(),
                                  batch.off_policy.double(), gamma=0.5)
    ratio = torch.tensor([math.exp(-0.5), 1.0], dtype=torch.float64)  # a hint that changes nothing gives ratio 1
    assert torch.allclose(loss[0], -ratio / (ratio + 0.5))


def test_scaf_waits_out_the_exemption_then_climbs_the_tiers_and_replaces_one_failure():
    setup = hint_setup(library_of(**{"0": "w1 w2 w3 w4"}), needed_words=4)  # only the full solution helps
    cfg = rollout_config({"strategy": "scaf_hints", "n": 4, "scaf_hints": {"tiers": [0.25, 0.5, 1.0], "exemption_fraction": 0.5, "total_steps": 2}})
    strategy = make_strategy(cfg, setup)
    assert isinstance(strategy, ScafHints) and strategy.exempt_steps == 1
    graded, metrics = strategy.rollout([Problem("0", "q", "a")])
    assert metrics["groups_scaffolded"] == 0.0 and len(setup.sampler.engine.requests) == 1  # exemption: no hint
    graded, metrics = strategy.rollout([Problem("0", "q", "a")])
    tiers = [reqs[0][0] for reqs in setup.sampler.engine.requests[2:]]
    assert tiers == [(0,), (0,), (1000,)]  # a quarter and a half of the solution do not help; all of it does
    assert metrics["groups_scaffolded"] == 1.0 and graded.rewards.tolist() == [1.0, 0.0, 0.0, 0.0]
    rescued = graded.groups[0][0]
    # on-policy for the hinted prompt: the hint is in the prompt ids, never in the trained response
    assert rescued.prompt_ids == (1000,) and rescued.off_policy == [0, 0] and rescued.behaviour == "hint"
    assert ScafHints(setup, [1.0], 0).state_dict() == {"steps": 0}


def test_guidance_length_schedule_follows_the_three_step_rule():
    schedule = GuidanceLength(length=100, max_length=150)
    assert [schedule.update(a) for a in (0.4, 0.6)] == [100, 100]  # collect two steps
    assert schedule.update(0.25) == 150  # 0.25 < mean 0.5: length * 0.5 / 0.25 = 200, capped at 150
    assert [schedule.update(a) for a in (0.2, 0.4)] == [150, 150]
    assert schedule.update(0.6) == 75  # 0.6 > mean 0.3: 150 * 0.3 / 0.6
    assert [schedule.update(a) for a in (0.5, 0.5, 0.5)] == [75, 75, 75]  # equal: unchanged
    assert [schedule.update(a) for a in (0.0, 0.0, 0.1)] == [75, 75, 75]  # a zero mean: unchanged
    assert [schedule.update(a) for a in (0.5, 0.5, 0.0)] == [75, 75, 75]  # a zero accuracy: unchanged
    tiny = GuidanceLength(length=2, max_length=8)
    assert [tiny.update(a) for a in (0.1, 0.1, 0.9)] == [2, 2, 1]  # at least one token


def test_guided_prefix_groups_hold_k_guided_responses_whose_prefix_is_context():
    setup = hint_setup(library_of(**{"0": "x"}))
    cfg = rollout_config({"strategy": "guided_prefix", "n": 4, "guided_prefix": {"guided_per_group": 1, "initial_length": 2, "max_length": 3}})
    strategy = make_strategy(cfg, setup)
    assert isinstance(strategy, GuidedPrefix)
    graded, metrics = strategy.rollout([Problem("0", "q", "a"), Problem("1", "q", "a")])
    assert setup.sampler.engine.requests[0] == [((0,), 1, (2, 4)), ((0,), 3, ()), ((1,), 4, ())]  # trace (2, 4, 6, EOS)
    guided = graded.groups[0][0]
    assert guided.behaviour == "prefix" and guided.response_ids == [2, 4, 2] and guided.loss_mask == [0, 0, 1]
    assert [c.behaviour for c in graded.groups[0]] == ["prefix", "policy", "policy", "policy"]
    assert metrics["guidance_length"] == 2.0 and metrics["groups_guided"] == 1.0
    batch = collate(graded.groups, 0)
    assert batch.response_mask[0].tolist() == [0, 0, 1] and not batch.has_off_policy
    trained = GuidedPrefix(setup, 1, 2, 3, train_prefix=True).label(guided, 2)
    assert trained.off_policy == [1, 1, 0] and trained.behaviour_logprobs == [-0.5, -0.5, -0.5] and trained.loss_mask == [0, 0, 1]


# ----------------------------------------------------------------------------------------- off-policy correction pieces

from rlbench.algorithm.sampling_correction import SamplingCorrection  # noqa: E402


def test_masked_importance_sampling_and_token_rejection_in_closed_form():
    old = torch.zeros(1, 4, dtype=torch.float64)
    sampler = -torch.log(torch.tensor([[0.25, 0.8, 1.5, 3.0]], dtype=torch.float64))  # rho = 0.25, 0.8, 1.5, 3
    mask = torch.ones(1, 4, dtype=torch.float64)
    truncate = SamplingCorrection.from_config({"cap": 2.0})
    assert torch.allclose(truncate.weights(old, sampler), torch.tensor([[0.25, 0.8, 1.5, 2.0]], dtype=torch.float64))
    masked = SamplingCorrection.from_config({"cap": 2.0, "mode": "mask"})  # keeps rho in [1/2, 2]
    assert torch.allclose(masked.weights(old, sampler), torch.tensor([[0.0, 0.8, 1.5, 0.0]], dtype=torch.float64))
    rejected = SamplingCorrection.from_config({"cap": 2.0, "mode": "reject", "low": 0.1})  # keeps rho in [0.1, 2]
    weights = rejected.weights(old, sampler)
    assert weights.tolist() == [[1.0, 1.0, 1.0, 0.0]]
    assert rejected.metrics(weights, mask) == {"sampling_rejected_fraction": 0.25}
    with pytest.raises(ConfigError, match="mode='clip' is unknown"):
        SamplingCorrection.from_config({"mode": "clip"})
    with pytest.raises(ConfigError, match="low must lie in"):
        SamplingCorrection.from_config({"cap": 2.0, "low": 3.0})


def test_the_correction_never_reweights_a_trace_token():
    trace = trace_completion(Trace("u", "", (2, 4), "teacher"), (1,))
    batch = collate([[trace]], 0)
    old = behaviour_old_logp(batch, torch.full((1, 2), -3.0))  # the trace's pi_old is its behaviour log-prob 0
    for mode in ("truncate", "mask", "reject"):
        assert SamplingCorrection(2.0, mode).weights(old, batch.sampling_logp).tolist() == [[1.0, 1.0]]


from rlbench.rollout.guided.dataset_reset import DatasetReset  # noqa: E402


def test_dataset_reset_starts_groups_from_a_uniform_cut_of_the_solution_as_context():
    library = GuidanceLibrary()
    library.add(Trace("0", "", (2, 4, 6, 0), "dataset"))  # body (2, 4, 6): depths 0..3
    setup = hint_setup(library)
    generator = torch.Generator().manual_seed(0)
    setup = RolloutSetup(setup.sampler, 4, setup.params, generator, guidance=library)
    strategy = make_strategy(rollout_config({"strategy": "dataset_reset", "n": 4, "dataset_reset": {"p_reset": 1.0}}), setup)
    assert isinstance(strategy, DatasetReset)
    depths = [strategy.reset_depth((2, 4, 6)) for _ in range(4000)]
    for h in range(4):  # uniform on 0..3
        assert abs(depths.count(h) / 4000 - 0.25) < 0.03
    graded, metrics = strategy.rollout([Problem("0", "q", "a")])
    (prompt, n, prefix), = setup.sampler.engine.requests[-1]
    assert n == 4 and prefix == (2, 4, 6)[: len(prefix)]
    if prefix:
        c = graded.groups[0][0]
        assert c.behaviour == "reset" and c.loss_mask == [0] * len(prefix) + [1] and metrics["groups_reset"] == 1.0


def test_dataset_reset_at_probability_zero_is_iid_and_draws_nothing():
    library = GuidanceLibrary()
    library.add(Trace("0", "", (2, 4, 0), "dataset"))
    generator = torch.Generator().manual_seed(3)
    base = hint_setup(library)
    setup = RolloutSetup(base.sampler, 4, base.params, generator, guidance=library)
    state = generator.get_state()
    graded, metrics = DatasetReset(setup, 0.0).rollout([Problem("0", "q", "a")])
    assert torch.equal(generator.get_state(), state) and setup.sampler.engine.requests == [[((0,), 4, ())]]
    assert metrics["groups_reset"] == 0.0 and all(c.behaviour == "policy" for c in graded.groups[0])


def test_hardest_problem_set_and_unbiased_pass_at_k():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from hardest_problems import hard_set, pass_at_k

    assert pass_at_k(8, 0, 1) == 0.0 and pass_at_k(8, 8, 4) == 1.0
    assert pass_at_k(8, 2, 1) == pytest.approx(0.25) and pass_at_k(4, 1, 2) == pytest.approx(0.5)
    rows = [{"phase": "before", "benchmark": "b", "uid": f"u{i}", "n": "8", "correct": str(c)} for i, c in enumerate([0, 3, 0, 5])]
    assert hard_set(rows) == {("b", "u0"), ("b", "u2")}  # never solved before training
    solved = [dict(r, correct="1") for r in rows] + [{"phase": "before", "benchmark": "b", "uid": f"v{i}", "n": "8", "correct": "2"} for i in range(6)]
    assert hard_set(solved) == {("b", "u0")}  # none unsolved: the decile with the fewest correct (1 of 10)


from rlbench.rollout.guided.icl_expert import InContextExpert, expert_bonus  # noqa: E402


def test_icpo_bonus_anneals_from_beta_to_zero():
    assert [expert_bonus(t, 1.0, 400) for t in (0, 200, 400, 800)] == [1.0, 0.5, 0.0, 0.0]


def test_icpo_expert_is_sampled_with_a_demonstration_trained_without_it_and_rejected_when_wrong():
    library = library_of(**{"0": "w1", "1": "v1"})
    base = hint_setup(library)  # a prompt with a demonstration ("Hint:"-free) is encoded as the plain prompt ...

    class Sampler(type(base.sampler)):
        def encode(self, problems):  # ... except that a demonstration makes the answer right for uid 0 only
            return [((1000 if p.uid == "0" else 0) + int(p.uid),) if "Example problem" in p.prompt else (int(p.uid),) for p in problems]

    sampler = Sampler(base.sampler.engine, base.sampler.grader, base.sampler.tokenizer, {}, lambda r, _: r)
    setup = RolloutSetup(sampler, 4, base.params, torch.Generator().manual_seed(0), guidance=library)
    strategy = make_strategy(rollout_config({"strategy": "icl_expert", "n": 4, "icl_expert": {"beta": 1.0, "horizon": 2}}), setup)
    assert isinstance(strategy, InContextExpert)
    graded, metrics = strategy.rollout([Problem("0", "q", "a"), Problem("1", "q", "a")])
    requests = sampler.engine.requests
    assert requests[0] == [((0,), 3, ()), ((1,), 3, ())] and requests[1] == [((1000,), 1, ()), ((1,), 1, ())]
    assert requests[2] == [((1,), 1, ())]  # the wrong expert of prompt 1 is replaced by a policy response
    expert = graded.groups[0][-1]
    assert expert.behaviour == "expert" and expert.prompt_ids == (0,) and expert.off_policy == [1, 1]
    assert expert.behaviour_logprobs == [0.0, 0.0]  # mu = 1 (ICPO shapes pi_theta, as LUFFY)
    assert [c.behaviour for c in graded.groups[1]] == ["policy"] * 4
    assert graded.rewards.tolist() == [0.0, 0.0, 0.0, 2.0] + [0.0] * 4  # reward 1 + bonus 1 at step 0
    assert metrics == {"expert_responses": 1.0, "experts_rejected": 1.0, "expert_bonus": 1.0, "rollout_outcome_mean": 0.0}
    _, later = strategy.rollout([Problem("0", "q", "a"), Problem("1", "q", "a")])
    assert later["expert_bonus"] == 0.5
