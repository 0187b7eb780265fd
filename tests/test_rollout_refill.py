"""In-engine refill (rlbench/rollout/engines/refill.py, the HF engine's ``generate_refilling``; Infinite Sampling,
arXiv:2506.22950, section 3) and its use by rollout=micro_groups (``refill: true``): every sample decoded
through the refilling slots equals the same sample decoded alone (greedy and sampled on its own seed; both
decoding paths), the slots bound every forward pass, the queue is taken in order, the scheduler's order and
step count by hand, and the refusals."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from rlbench.config.typed import rollout_config
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.reward.toy import EvenTokenReward
from rlbench.rollout import GenerationRequest, GroupSampler, HFGenerateEngine, RolloutSetup, SamplingParams, make_strategy, validate_strategy
from rlbench.rollout.engines.hf import ModelSteps
from rlbench.rollout.engines.lean_decode import LeanSteps
from rlbench.rollout.engines.refill import join_rows
from rlbench.rollout.strategies.micro_groups import pack_by_length, refill_steps, shortest_first

from test_lean_decode import Tokenizer, small_model
from test_tree_cores import SeededEngine, micro_setup

# Prompts of 1 to 12 tokens; the short ones first, so that longer prompts join a cache narrower than
# themselves (the running rows are left-extended) and shorter ones a wider cache.
PROMPTS = [(4,), (77, 78), (1000, 2000, 3000), tuple(range(100, 112)), (5, 17, 300, 4000, 9), (77, 79),
           (7, 8, 9, 10, 11, 12, 13, 14, 15), (3000, 1)]
BUDGET = 14
TOLERANCE = 1e-5


def engine_with_endings(lean: bool, temperature: float) -> HFGenerateEngine:
    """The small Llama's engine with EOS ids chosen so that the samples end at different steps: greedy, the
    token each prompt's alone-decoded response has at a step of its own; sampled, one id in eight."""
    engine = HFGenerateEngine(small_model("llama"), Tokenizer(), progress=False, lean_decode=lean)
    if temperature > 0:
        engine.eos_ids = list(range(2, 4096, 8))
        return engine
    engine.eos_ids = [4095]
    params = SamplingParams(0.0, 1.0, BUDGET)
    alone = [engine.generate([GenerationRequest(p)], params)[0][0].response_ids for p in PROMPTS]
    engine.eos_ids = [alone[i][step] for i, step in enumerate([1, 5, 9, 3, 13, 6, 2, 11])]
    return engine


@pytest.mark.parametrize("lean", [True, False], ids=["lean-steps", "model-forward"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_every_refilled_sample_equals_the_sample_decoded_alone(lean, temperature, monkeypatch):
    """Eight samples of prompts of 1-12 tokens, ending at different steps, through 3 slots: each has the tokens
    of its decoding alone and its log-probs within 1e-5; every step and prefill holds at most 3 rows; the
    queue joins in order; each sample is fed back once per token but its last."""
    seeds = [11 * i + 3 for i in range(len(PROMPTS))] if temperature > 0 else None
    engine = engine_with_endings(lean, temperature)
    assert (engine._lean_decoder() is not None) == lean
    params = SamplingParams(temperature, 1.0, BUDGET)
    requests = [GenerationRequest(p, seed=None if seeds is None else seeds[i]) for i, p in enumerate(PROMPTS)]
    alone = [engine.generate([r], params)[0][0] for r in requests]
    lengths = [len(c.response_ids) for c in alone]
    assert len(set(lengths)) >= 4 and max(lengths) <= BUDGET  # the samples end at different steps

    steps, prefills = [], []
    for cls in (ModelSteps, LeanSteps):
        original_step = cls.step
        monkeypatch.setattr(cls, "step", lambda self, tokens, positions, _f=original_step: steps.append(len(tokens)) or _f(self, tokens, positions))
    original_prefill = HFGenerateEngine._prefill
    monkeypatch.setattr(HFGenerateEngine, "_prefill", lambda self, seqs, keep: prefills.append(list(seqs)) or original_prefill(self, seqs, keep))
    out = engine.generate_refilling(requests, params, slots=3)

    assert [len(group) for group in out] == [1] * len(PROMPTS)  # no sample lost or duplicated
    for i, (a, (b,)) in enumerate(zip(alone, out)):
        assert b.request_index == i and b.prompt_ids == a.prompt_ids
        assert b.response_ids == a.response_ids and b.finished == a.finished, i
        assert torch.allclose(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=0, atol=TOLERANCE), i
    assert max(steps) <= 3 and max(len(p) for p in prefills) <= 3
    assert [p for batch in prefills for p in batch] == PROMPTS  # each sample joins once, in the queue's order
    assert len(prefills) > 1  # samples joined while others ran
    assert sum(steps) == sum(n - 1 for n in lengths)  # each token but a sample's last is fed back once
    assert len(steps) <= refill_steps(lengths, 3) <= len(steps) + len(prefills)


def test_the_queue_joins_in_order_and_equal_prompts_share_a_prefill(monkeypatch):
    """Four samples of two prompts through 4 slots join at once in one prefill of the 2 distinct prompts;
    through 1 slot one by one, in the queue's order."""
    engine = HFGenerateEngine(small_model("llama"), Tokenizer(), progress=False)
    prefills = []
    original_prefill = HFGenerateEngine._prefill
    monkeypatch.setattr(HFGenerateEngine, "_prefill", lambda self, seqs, keep: prefills.append(list(seqs)) or original_prefill(self, seqs, keep))
    requests = [GenerationRequest((9, 8, 7), n=2, seed=1), GenerationRequest((5,), n=2, seed=2)]
    params = SamplingParams(1.0, 1.0, 4)
    wide = engine.generate_refilling(requests, params, slots=4)
    assert prefills == [[(9, 8, 7), (5,)]]
    prefills.clear()
    narrow = engine.generate_refilling(requests, params, slots=1)
    assert prefills == [[(9, 8, 7)], [(9, 8, 7)], [(5,)], [(5,)]]
    assert [[c.response_ids for c in g] for g in wide] == [[c.response_ids for c in g] for g in narrow]
    assert wide[0][0].response_ids != wide[0][1].response_ids  # sample k of a request has a stream of its own


def test_join_rows_right_aligns_and_drops_the_columns_nobody_reads():
    """Old rows of 5 columns, the first two unused by every row, the second row reading only its last 2;
    new rows of 4 columns: 4 columns remain, the old rows' keys in the right-most 3, masks as written."""
    old_k = torch.arange(2 * 5, dtype=torch.float32).view(2, 1, 5, 1)
    old_valid = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, 1, 1]], dtype=torch.bool)
    new_k = -torch.arange(1, 5, dtype=torch.float32).view(1, 1, 4, 1)
    (keys, values), = join_rows([(old_k, old_k)], old_valid, [(new_k, new_k)], None, room=2)[0]
    _, valid, width = join_rows([(old_k, old_k)], old_valid, [(new_k, new_k)], None, room=2)
    assert width == 4 and keys.shape == (3, 1, 6, 1) and torch.equal(keys, values)
    assert keys[:, 0, :, 0].tolist() == [[0, 2, 3, 4, 0, 0], [0, 7, 8, 9, 0, 0], [-1, -2, -3, -4, 0, 0]]
    assert valid.long().tolist() == [[0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]


def test_shortest_first_and_the_refill_step_count_by_hand():
    assert shortest_first([5.0, 1.0, 9.0, 1.0, 3.0]) == [1, 3, 4, 0, 2]  # ties by index
    # 2 slots: row A takes 5 (steps 0-4); row B takes 1 (step 0), 1 (step 1), 3 (steps 2-4): 5 steps
    assert refill_steps([5, 1, 1, 3], 2) == 5
    # packed rounds of 2 would take max(5, 1) + max(1, 3) = 8 steps
    assert refill_steps([5, 1, 1, 3], 1) == 10 and refill_steps([2, 2], 4) == 2 and refill_steps([], 3) == 0


def test_the_packed_rounds_refilled_shortest_first_are_the_shortest_first_queue():
    """The two-stage plan (group into rounds with pack_by_length, run the rounds shortest first and each
    round's jobs shortest first) flattens to one queue sorted shortest predicted first (equal predictions
    may come in another order: the packing breaks ties longest first)."""
    generator = torch.Generator().manual_seed(0)
    for capacity in (1, 2, 3, 5):
        predicted = [float(x) for x in torch.randint(1, 6, (11,), generator=generator)]
        key = lambda j: (predicted[j], j)  # noqa: E731
        two_stage = [j for round_ in pack_by_length(predicted, capacity) for j in sorted(round_, key=key)]
        assert sorted(two_stage) == list(range(11))
        assert [predicted[j] for j in two_stage] == [predicted[j] for j in shortest_first(predicted)] == sorted(predicted)


class RefillingEngine(SeededEngine):
    """The scripted engine with a refilling call: records each call's queue (prompt ids) and slot count."""

    def __init__(self):
        super().__init__()
        self.queues = []

    def generate_refilling(self, requests, params, slots, generator=None):
        self.queues.append(([r.prompt_ids[0] for r in requests], slots))
        return self.generate(requests, params, generator)


def test_micro_groups_refill_queues_shortest_first_and_keeps_the_groups(monkeypatch):
    """rollout.micro_groups.refill: one call per step of max_sequences slots; the queue is the micro-groups
    shortest predicted first once the lengths are known; the groups equal full-group sampling; the padding is
    the share of slot-steps left empty (refill_steps)."""
    import test_tree_cores

    monkeypatch.setattr(test_tree_cores, "SeededEngine", RefillingEngine)
    problems = [Problem(str(u), "q", "a") for u in (8, 1, 5)]
    refill, engine = micro_setup(n=4, size=2, max_sequences=4, length_aware=True, refill=True)
    whole, _ = micro_setup(n=4, size=4)
    for step in range(2):
        (r, metrics), (w, _) = refill.rollout(problems), whole.rollout(problems)
        assert [[c.response_ids for c in g] for g in r.groups] == [[c.response_ids for c in g] for g in w.groups]
        assert metrics["micro_group_rounds"] == 1.0
        queue, slots = engine.queues[step]
        assert slots == 4 and sorted(queue) == sorted([8, 1, 5] * 4)
        # step 0: nothing known, the rounds' order; step 1: shortest first, a micro-group's 2 responses together
        assert queue == ([8, 8, 1, 1, 5, 5] * 2 if step == 0 else [1] * 4 + [5] * 4 + [8] * 4)
        lengths = [min(p, 8) for p in queue]
        assert metrics["micro_group_padding"] == pytest.approx(1 - sum(lengths) / (4 * refill_steps(lengths, 4)))


def test_refill_is_refused_where_the_engine_cannot_refill():
    with pytest.raises(ConfigError, match="refill=true refills slots inside the HF engine.*rollout.engine=vllm"):
        validate_strategy(rollout_config({"strategy": "micro_groups", "n": 8, "engine": "vllm",
                                          "micro_groups": {"size": 4, "refill": True}}), "grpo")
    validate_strategy(rollout_config({"strategy": "micro_groups", "n": 8, "micro_groups": {"size": 4, "refill": True}}), "grpo")
    with pytest.raises(ConfigError, match="needs an engine that refills slots.*SeededEngine does not"):
        micro_setup(n=4, size=2, refill=True)


def test_micro_groups_with_refill_on_the_tiny_model_give_the_full_groups(tiny_model):
    """The strategy through the HF engine: with refill (3 slots for 2 prompts x 8 responses) the groups are
    those of full-group sampling (tokens equal, log-probs within 1e-5) and their rewards equal."""
    model, tokenizer = tiny_model

    def run(micro):
        engine = HFGenerateEngine(model, tokenizer, progress=False)
        engine.eos_ids = list(range(2, len(tokenizer), 6))  # responses of unequal lengths
        sampler = GroupSampler(engine, EvenTokenReward(), tokenizer, {"system": None, "user": "{problem}"}, lambda r, _: r)
        setup = RolloutSetup(sampler, 8, SamplingParams(1.0, 1.0, 12), torch.Generator().manual_seed(5))
        strategy = make_strategy(rollout_config({"strategy": "micro_groups", "n": 8, "micro_groups": micro}), setup)
        return strategy.rollout([Problem("p0", "1 + 2", "3"), Problem("p1", "what is three plus four", "7")])

    (refilled, metrics), (whole, _) = run({"size": 2, "max_sequences": 3, "refill": True}), run({"size": 8})
    assert [[c.response_ids for c in g] for g in refilled.groups] == [[c.response_ids for c in g] for g in whole.groups]
    assert len({len(c.response_ids) for g in whole.groups for c in g}) >= 3
    for a, b in zip((c for g in refilled.groups for c in g), (c for g in whole.groups for c in g)):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=TOLERANCE)
    assert torch.equal(refilled.rewards, whole.rewards) and 0.0 <= metrics["micro_group_padding"] < 1.0


@pytest.fixture(scope="module")
def tiny_model():
    from conftest import model_preset
    from rlbench.model import load_policy

    return load_policy(model_preset("tiny"), seed=0)
