"""EDGE-GRPO's Guided Error Correction (rollout=edge_gec; arXiv:2507.21848, sec. 3.3) on a scripted engine:
the branch probabilities, the trigger (accuracy + format below 2), what each correction makes of a wrong
response (tokens, labels, the reflection's continuation request), that right, well-formatted responses are
untouched and the groups graded again, the injected tokens' pi_old recomputed by the policy (ratio 1 at
theta = theta_old, on the tiny model), and the config checks."""

import pytest
import torch
from conftest import CharTokenizer, compose_config

from rlbench.config.typed import rollout_config
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.guidance.traces import GuidanceLibrary, Trace
from rlbench.model.loading import build_tiny_model
from rlbench.reward.math import MathReward
from rlbench.rollout import GroupSampler, RolloutSetup, make_strategy, validate_strategy
from rlbench.rollout.engines.base import Completion, SamplingParams
from rlbench.rollout.guided.edge_gec import (
    ANSWER_TEMPLATE,
    REFLECTION,
    correction_branch,
    needs_correction,
)
from rlbench.training.batch import collate
from rlbench.training.forward import batch_outputs
from rlbench.training.step import behaviour_old_logp
from rlbench.validation import validate_config

EOS = 1
WRONG = " so 7"  # the scripted policy's default answer: 7 without \boxed, the reference is 2
SOLUTION = "1+1 = 2, so \\boxed{2}"
BOXED = " so \\boxed{7}"  # the answer 7 in the format


class EosCharTokenizer(CharTokenizer):
    """Characters as token ids, with an EOS id that decodes to nothing."""

    eos_token_id = EOS
    pad_token_id = 0
    bos_token_id = None

    def __len__(self):  # ASCII: the tiny model's vocabulary
        return 128

    def encode(self, text, add_special_tokens=False):
        return [ord(ch) for ch in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i != EOS)


class ScriptedEngine:
    """Every request gets its prefix and then ``answer`` + EOS, cut at the call's max_new_tokens; records the requests."""

    def __init__(self, answer=WRONG):
        self.calls, self.answer = [], answer

    def generate(self, requests, params, generator=None):
        self.calls.append([(r.prompt_ids, r.prefix_ids, r.n, params.max_new_tokens) for r in requests])
        new = [ord(ch) for ch in self.answer] + [EOS]
        out = []
        for i, r in enumerate(requests):
            kept = new[: params.max_new_tokens]
            response = list(r.prefix_ids) + kept
            text = EosCharTokenizer().decode(response)
            out.append([Completion(i, r.prompt_ids, response, [-0.5] * len(response), kept[-1] == EOS, text=text,
                                   prefix_len=len(r.prefix_ids)) for _ in range(r.n)])
        return out


def strategy(n=4, seed=0, guidance=True, answer=WRONG, budget=8, **block):
    tokenizer = EosCharTokenizer()
    engine = ScriptedEngine(answer)
    sampler = GroupSampler(engine, MathReward(), tokenizer, {}, lambda rewards, _: rewards)
    library = GuidanceLibrary({"0": [Trace("0", SOLUTION, tuple(ord(ch) for ch in SOLUTION) + (EOS,), "dataset")]}) if guidance else None
    setup = RolloutSetup(sampler, n, SamplingParams(1.0, 1.0, budget), torch.Generator().manual_seed(seed), guidance=library)
    config = rollout_config({"strategy": "edge_gec", "n": n, "edge_gec": block} if block else {"strategy": "edge_gec", "n": n})
    return make_strategy(config, setup), engine, tokenizer


def test_branch_probabilities_are_the_authors_half_quarter_quarter():
    generator = torch.Generator().manual_seed(0)
    draws = [correction_branch(generator) for _ in range(8000)]
    shares = {branch: draws.count(branch) / len(draws) for branch in ("reflection", "answer", "solution")}
    assert shares == pytest.approx({"reflection": 0.5, "answer": 0.25, "solution": 0.25}, abs=0.02)
    again = torch.Generator().manual_seed(0)
    assert [correction_branch(again) for _ in range(50)] == draws[:50]  # the rollout's stream decides


def test_every_wrong_response_is_corrected_and_the_group_graded_again():
    gec, engine, tokenizer = strategy(n=16, seed=1)
    graded, metrics = gec.rollout([Problem("0", "1+1?", "2")])
    own = [ord(ch) for ch in WRONG]  # the sampled response without its EOS
    labels = [c.behaviour for c in graded.groups[0]]
    assert metrics["rollout_outcome_mean"] == 0.0  # the policy alone never answers 2
    counts = {b: labels.count(f"gec_{b}") for b in ("reflection", "answer", "solution")}
    assert all(counts.values()) and sum(counts.values()) == 16
    assert {k: metrics[f"gec_{k}"] for k in counts} == {k: float(v) for k, v in counts.items()}
    for completion, grade in zip(graded.groups[0], graded.grades):
        ids = completion.response_ids
        if completion.behaviour == "gec_reflection":
            phrase = [ord(ch) for ch in REFLECTION]
            assert ids == own + phrase + own + [EOS]  # the policy continued after the phrase
            assert completion.finished and not grade.correct
        elif completion.behaviour == "gec_answer":
            sentence = ANSWER_TEMPLATE.replace("{answer}", "2")
            assert tokenizer.decode(ids) == WRONG + sentence and ids[-1] == EOS
            assert grade.correct
        else:
            assert tokenizer.decode(ids) == SOLUTION and grade.correct
        assert completion.off_policy is None and completion.behaviour_logprobs is None  # the policy's: pi_old recomputed
    assert metrics["gec_correct"] == counts["answer"] + counts["solution"]
    # one engine call for the group, one for the reflections: each continues own + phrase for <= 256 tokens
    first, reflections = engine.calls
    assert [(prefix, n, budget) for _, prefix, n, budget in first] == [((), 16, 8)]  # rollout.n at the run's budget
    assert len(reflections) == counts["reflection"]
    assert all(prefix == tuple(own + [ord(ch) for ch in REFLECTION]) and budget <= 256 for _, prefix, n, budget in reflections)
    batch = collate(graded.groups, 0)  # no token keeps a behaviour probability of 1: pi_old is the policy's
    assert not batch.has_off_policy and batch.behaviour_logp is None


def test_a_right_but_unboxed_response_scores_below_two_and_is_corrected_a_boxed_one_is_not():
    """The paper's trigger: accuracy + format < 2. " so 7" is right for 9 - 2 but has no \\boxed answer."""
    problem = Problem("0", "what is 9 - 2?", "7")
    gec, engine, _ = strategy(n=8, seed=1, guidance=False)
    graded, metrics = gec.rollout([problem])
    first = gec.setup.sampler.grade([problem], [[engine_completion(WRONG)]], 8).grades[0]
    assert first.correct and not first.format_ok and needs_correction(first)
    assert metrics["rollout_outcome_mean"] == 1.0  # every sample right ...
    assert all(c.behaviour.startswith("gec_") for c in graded.groups[0])  # ... and every one corrected
    assert metrics["gec_reflection"] + metrics["gec_answer"] == 8.0
    gec, engine, _ = strategy(n=8, seed=1, guidance=False, answer=BOXED, budget=16)
    graded, metrics = gec.rollout([problem])  # right and boxed: score 2, left alone, graded once
    assert all(c.behaviour == "policy" for c in graded.groups[0]) and len(engine.calls) == 1
    assert metrics["gec_reflection"] + metrics["gec_answer"] + metrics["gec_solution"] == 0.0
    assert graded.grades[0].correct and graded.grades[0].format_ok and not needs_correction(graded.grades[0])


def engine_completion(text):
    ids = [ord(ch) for ch in text] + [EOS]
    return Completion(0, (1,), ids, [-0.5] * len(ids), True, text=text)


def test_injected_tokens_old_logprobs_are_the_policy_forward_so_the_first_ratio_is_one():
    """pi_old of the corrected completions (every branch) is the tiny policy's log-prob of each token before the
    update, the injected text included (not log 1): the step's path, a no-grad pass then behaviour_old_logp."""
    gec, _, tokenizer = strategy(n=8, seed=1)
    graded, _ = gec.rollout([Problem("0", "1+1?", "2")])
    assert {c.behaviour for c in graded.groups[0]} == {"gec_reflection", "gec_answer", "gec_solution"}
    model = build_tiny_model(tokenizer, seed=3)
    batch = collate(graded.groups, tokenizer.pad_token_id)
    old = behaviour_old_logp(batch, batch_outputs(model, batch, 4, 1.0).logp)
    own = len(WRONG)  # the response's own tokens before the injected text (solution: none)
    for row, completion in enumerate(graded.groups[0]):
        ids = list(completion.prompt_ids) + completion.response_ids
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        start = len(completion.prompt_ids)
        direct = torch.log_softmax(logits[start - 1 : -1], dim=-1).gather(-1, torch.tensor(ids[start:])[:, None])[:, 0]
        r = len(completion.response_ids)
        assert torch.allclose(old[row, :r], direct, atol=1e-5)
        injected = slice(0 if completion.behaviour == "gec_solution" else own, r)
        assert float(old[row, injected].max()) < -1.0  # a random 128-id policy: far from log 1
    ratio = torch.exp(batch_outputs(model, batch, 4, 1.0).logp - old) * batch.response_mask
    assert torch.allclose(ratio, batch.response_mask, atol=1e-5)  # theta = theta_old: ratio 1 on every token


def test_right_responses_are_left_alone_and_without_a_trace_the_solution_becomes_the_answer():
    gec, engine, _ = strategy(n=16, seed=1, guidance=False, answer=BOXED, budget=16)
    graded, metrics = gec.rollout([Problem("0", "what is 9 - 2?", "7")])  # the scripted answer is right and boxed
    assert metrics["rollout_outcome_mean"] == 1.0 and len(engine.calls) == 1
    assert all(c.behaviour == "policy" for c in graded.groups[0]) and metrics["gec_correct"] == 0.0
    graded, metrics = gec.rollout([Problem("1", "1+1?", "2")])  # no trace for this problem: answer instead
    assert metrics["gec_solution"] == 0.0 and metrics["gec_answer"] > 0 and metrics["gec_reflection"] > 0


def test_edge_gec_settings_are_checked():
    assert validate_strategy(rollout_config({"strategy": "edge_gec", "n": 4}), "edge_grpo") is None
    with pytest.raises(ConfigError, match="reflection_tokens must be >= 1"):
        strategy(reflection_tokens=0)
    with pytest.raises(ConfigError, match=r"answer_template must contain \{answer\}"):
        strategy(answer_template="the answer is")


@pytest.mark.parametrize("setting, message", [
    ("+algorithm.sampling_correction.cap=2.0", "sampling_correction=null"), ("trainer.max_staleness=1", "max_staleness=null"),
])
def test_readers_of_the_placeholder_sampling_logprobs_are_refused(setting, message, tmp_path):
    """The injected text's pi_old is recomputed; its sampling log-probs are placeholders nobody may weigh by."""
    validate_config(compose_config(["experiment=smoke", "rollout=edge_gec", "guidance=dataset"], tmp_path))
    with pytest.raises(ConfigError, match=message):
        validate_config(compose_config(["experiment=smoke", "rollout=edge_gec", "guidance=dataset", setting], tmp_path))
