"""EDGE-GRPO's Guided Error Correction (rollout=edge_gec; arXiv:2507.21848, sec. 3.3) on a scripted engine:
the branch probabilities, what each correction makes of a wrong response (tokens, labels, behaviour
log-probs, the reflection's continuation request), that right responses are untouched and the groups
graded again, and the config checks."""

import pytest
import torch
from conftest import CharTokenizer

from rlbench.config.typed import rollout_config
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.guidance.traces import GuidanceLibrary, Trace
from rlbench.reward.math import MathReward
from rlbench.rollout import GroupSampler, RolloutSetup, make_strategy, validate_strategy
from rlbench.rollout.engines.base import Completion, SamplingParams
from rlbench.rollout.guided.edge_gec import (
    ANSWER_TEMPLATE,
    REFLECTION,
    correction_branch,
)
from rlbench.training.batch import collate

EOS = 1
WRONG = " so 7"  # the scripted policy's answer: 7, the reference is 2
SOLUTION = "1+1 = 2, so \\boxed{2}"


class EosCharTokenizer(CharTokenizer):
    """Characters as token ids, with an EOS id that decodes to nothing."""

    eos_token_id = EOS
    pad_token_id = 0

    def encode(self, text, add_special_tokens=False):
        return [ord(ch) for ch in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i != EOS)


class ScriptedEngine:
    """Every request gets its prefix and then WRONG + EOS, cut at the call's max_new_tokens; records the requests."""

    def __init__(self):
        self.calls = []

    def generate(self, requests, params, generator=None):
        self.calls.append([(r.prompt_ids, r.prefix_ids, r.n, params.max_new_tokens) for r in requests])
        new = [ord(ch) for ch in WRONG] + [EOS]
        out = []
        for i, r in enumerate(requests):
            kept = new[: params.max_new_tokens]
            response = list(r.prefix_ids) + kept
            text = EosCharTokenizer().decode(response)
            out.append([Completion(i, r.prompt_ids, response, [-0.5] * len(response), kept[-1] == EOS, text=text,
                                   prefix_len=len(r.prefix_ids)) for _ in range(r.n)])
        return out


def strategy(n=4, seed=0, guidance=True, **block):
    tokenizer = EosCharTokenizer()
    engine = ScriptedEngine()
    sampler = GroupSampler(engine, MathReward(), tokenizer, {}, lambda rewards, _: rewards)
    library = GuidanceLibrary({"0": [Trace("0", SOLUTION, tuple(ord(ch) for ch in SOLUTION) + (EOS,), "dataset")]}) if guidance else None
    setup = RolloutSetup(sampler, n, SamplingParams(1.0, 1.0, 8), torch.Generator().manual_seed(seed), guidance=library)
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
            assert completion.off_policy == [0] * len(own) + [1] * len(phrase) + [0] * (len(own) + 1)
            assert completion.behaviour_logprobs == [-0.5] * len(own) + [0.0] * len(phrase) + [-0.5] * (len(own) + 1)
            assert completion.finished and not grade.correct
        elif completion.behaviour == "gec_answer":
            sentence = ANSWER_TEMPLATE.replace("{answer}", "2")
            assert tokenizer.decode(ids) == WRONG + sentence and ids[-1] == EOS
            assert completion.off_policy == [0] * len(own) + [1] * (len(sentence) + 1)
            assert completion.behaviour_logprobs[len(own):] == [0.0] * (len(sentence) + 1)
            assert grade.correct
        else:
            assert tokenizer.decode(ids) == SOLUTION and completion.off_policy == [1] * len(ids) and grade.correct
    assert metrics["gec_correct"] == counts["answer"] + counts["solution"]
    # one engine call for the group, one for the reflections: each continues own + phrase for <= 256 tokens
    first, reflections = engine.calls
    assert [(prefix, n, budget) for _, prefix, n, budget in first] == [((), 16, 8)]  # rollout.n at the run's budget
    assert len(reflections) == counts["reflection"]
    assert all(prefix == tuple(own + [ord(ch) for ch in REFLECTION]) and budget <= 256 for _, prefix, n, budget in reflections)
    batch = collate(graded.groups, 0)  # the trainer reads the injected tokens as off-policy with mu = 1
    assert batch.has_off_policy and float(batch.behaviour_logp[batch.off_policy > 0].abs().sum()) == 0.0


def test_right_responses_are_left_alone_and_without_a_trace_the_solution_becomes_the_answer():
    gec, engine, _ = strategy(n=16, seed=1, guidance=False)
    graded, metrics = gec.rollout([Problem("0", "what is 9 - 2?", "7")])  # the scripted answer is right
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
