"""Micro-group sampling (``rollout=micro_groups``; Infinite Sampling, Wang et al. 2025, arXiv:2506.22950,
section 3: micro sampling groups): a prompt's group of ``rollout.n`` responses is decoded in rounds of
``size`` responses per prompt, so that the rows decoded at once stay bounded while the group (and its
statistics) stays whole.

Configuration (conf/rollout/micro_groups.yaml):

    micro_groups:
      size: 4            # responses per prompt decoded in one micro-group (rollout.n must be a multiple)
      max_sequences: 0   # responses decoded per engine call, micro-groups of any prompts (continuous
                         # sampling); 0: one micro-group of every prompt per call
      length_aware: false  # schedule the micro-groups by predicted length (below)
      refill: false      # one engine call whose finished rows take the next queued responses (below)

Every response draws its tokens from a random stream of its own: the step draws one seed per prompt
from the rollout's stream, and response k of the prompt samples with ``sample_seed(seed, k)`` (the
engine's per-request seeds), so its tokens do not depend on which round decodes it. The group is
therefore the same whatever ``size`` (on one device; up to the float effects of batch composition),
and so are its rewards and group statistics; ``size = n`` is full-group sampling. In each round the
prompt is prefilled once and its KV cache shared by the round's rows (the HF engine shares the prefill
of equal inputs).

**Length-aware scheduling** (the paper's section 3: continuous sampling with a length-aware scheduler).
The step's micro-groups are jobs of ``size`` responses; each engine call (a round) decodes up to
``max_sequences`` responses, micro-groups of any prompts, and lasts as long as its longest response. With
``length_aware`` a micro-group's length is predicted as the mean response length of its prompt when it
was last sampled (unknown: ``max_new_tokens``; the strategy keeps these per prompt, checkpointed), and
:func:`pack_by_length` groups the jobs into rounds (longest together: the sorted packing minimises the
sum of the rounds' predicted maxima, which the paper approximates with an FPTAS) and runs the rounds
shortest first (the paper's shortest-job-first). The schedule changes when a response is decoded,
never what is decoded: every response keeps its own seed, so the groups equal the unscheduled ones.
Metric ``micro_group_padding``: the share of the rounds' decode slots (rows x the round's longest
response) that no token used, what the scheduler lowers.

**Refill** (``refill: true``; the paper's shortest-job-first refill at runtime, section 3). One engine
call decodes the step's micro-groups as one queue in at most ``max_sequences`` rows (0: one micro-group
of every prompt), and a response that ends (EOS or ``max_new_tokens``) hands its slot to the next queued
response at the next step (the HF engine's ``generate_refilling``, rlbench/rollout/engines/refill.py), so
no row waits for the others. The queue is the micro-groups in :func:`shortest_first` order of their
predicted lengths with ``length_aware`` (SJF), else in the rounds' order; a micro-group's responses are
queued together. Every response keeps its own seed, so the groups are again those of full-group sampling;
``micro_group_padding`` is then the share of slot-steps left empty (:func:`refill_steps`), and
``micro_group_rounds`` counts the one call. Only the HF engine refills (others refused).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlbench.config.schema import RolloutConfig
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.rollout.engines.base import GenerationRequest, sample_seed
from rlbench.rollout.engines.hf import draw_seed
from rlbench.rollout.groups import GradedGroups
from rlbench.rollout.strategy import (
    RolloutSetup,
    RolloutStrategy,
    register_strategy,
    strategy_options,
)


@dataclass(frozen=True)
class MicroGroupsOptions:
    """The ``rollout.micro_groups`` block."""

    size: int = 4  # responses per prompt decoded per round; divides rollout.n
    max_sequences: int = 0  # responses per engine call (0: one micro-group of every prompt)
    length_aware: bool = False
    refill: bool = False  # one call whose finished rows take the next queued responses (the HF engine's)


def micro_groups_options(rollout: RolloutConfig) -> MicroGroupsOptions:
    """``rollout.micro_groups``, checked against ``rollout.n``."""
    options, n = strategy_options(rollout, "micro_groups", MicroGroupsOptions), rollout.n
    size = options.size
    if size < 1 or n % size:
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        raise ConfigError(
            f"rollout.micro_groups.size={size} must divide rollout.n={n} (each round decodes the same number of "
            f"responses per prompt); use one of {divisors}"
        )
    if options.max_sequences and options.max_sequences < size:
        raise ConfigError(
            f"rollout.micro_groups.max_sequences={options.max_sequences} cannot hold one micro-group of size={size}: "
            f"use 0 (one micro-group of every prompt per call) or a value >= {size}"
        )
    return options


def shortest_first(predicted: list[float]) -> list[int]:
    """The refill queue: job indices by predicted length, shortest first (ties by index), the paper's
    shortest-job-first order. It is also the two-stage plan flattened: the rounds of :func:`pack_by_length`
    (the global grouping), shortest round first, each round's jobs shortest first (ties aside)."""
    return sorted(range(len(predicted)), key=lambda j: (predicted[j], j))


def refill_steps(lengths: list[int], slots: int) -> int:
    """The decoding steps of a refilling engine call: responses of ``lengths`` tokens (queue order) each
    take the first free of ``slots`` rows, from the step after the row's last response ended (list
    scheduling); the step at which the last response ends, counted from 1."""
    import heapq

    free = [0] * min(slots, len(lengths))  # the first step each row is free
    end = 0
    for length in lengths:
        start = heapq.heappop(free)
        heapq.heappush(free, start + length)
        end = max(end, start + length)
    return end


def pack_by_length(predicted: list[float], capacity: int) -> list[list[int]]:
    """Rounds of job indices: the jobs sorted by predicted length, longest first (ties by index), cut into
    rounds of ``capacity`` jobs (the last, partial round holds the shortest), the rounds in shortest-first
    order. With equal-size rounds this minimises the sum over rounds of the longest predicted job."""
    order = sorted(range(len(predicted)), key=lambda j: (-predicted[j], j))
    rounds = [order[start : start + capacity] for start in range(0, len(order), capacity)]
    return rounds[::-1]


@register_strategy("micro_groups")
class MicroGroupSampling(RolloutStrategy):
    def __init__(self, setup: RolloutSetup, options: MicroGroupsOptions):
        self.setup, self.options = setup, options
        self.lengths: dict[str, float] = {}  # mean response length of each prompt when last sampled
        if options.refill and not hasattr(setup.sampler.engine, "generate_refilling"):
            raise ConfigError(f"rollout.micro_groups.refill=true needs an engine that refills slots while decoding (the "
                              f"HF engine); {type(setup.sampler.engine).__name__} does not: set refill=false")

    @classmethod
    def config_options(cls, rollout: RolloutConfig) -> dict[str, Any]:
        return {"options": micro_groups_options(rollout)}

    @classmethod
    def validate(cls, rollout: RolloutConfig, advantage: str) -> None:
        options = micro_groups_options(rollout)
        if options.refill and rollout.engine != "hf":
            raise ConfigError(f"rollout.micro_groups.refill=true refills slots inside the HF engine's decoding loop; "
                              f"rollout.engine={rollout.engine} cannot: use rollout.engine=hf or refill=false")

    def state_dict(self) -> dict[str, Any] | None:
        return {"lengths": dict(self.lengths)} if self.options.length_aware else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state:
            self.lengths = {str(k): float(v) for k, v in state["lengths"].items()}

    def schedule(self, problems: list[Problem]) -> list[list[tuple[int, int]]]:
        """The rounds: each a list of micro-groups ``(prompt index, first response index)``."""
        size, n = self.options.size, self.setup.n
        jobs = [(p, start) for start in range(0, n, size) for p in range(len(problems))]
        capacity = self.options.max_sequences // size if self.options.max_sequences else len(problems)
        if not self.options.length_aware:
            return [jobs[k : k + capacity] for k in range(0, len(jobs), capacity)]
        default = float(self.setup.params.max_new_tokens)
        predicted = [self.lengths.get(problems[p].uid, default) for p, _ in jobs]
        return [[jobs[j] for j in round_] for round_ in pack_by_length(predicted, capacity)]

    def queue(self, problems: list[Problem]) -> list[tuple[int, int]]:
        """The refill queue: the micro-groups ``(prompt index, first response index)``, shortest predicted
        first with ``length_aware`` (:func:`shortest_first`), else in the rounds' order."""
        size, n = self.options.size, self.setup.n
        jobs = [(p, start) for start in range(0, n, size) for p in range(len(problems))]
        if not self.options.length_aware:
            return jobs
        default = float(self.setup.params.max_new_tokens)
        return [jobs[j] for j in shortest_first([self.lengths.get(problems[p].uid, default) for p, _ in jobs])]

    def _decode(self, requests: list[GenerationRequest], slots: int) -> list[list[Any]]:
        """The refilling engine call (one queue, ``slots`` rows), counted in the sampler's cost."""
        sampler = self.setup.sampler
        start = time.perf_counter()
        out = sampler.engine.generate_refilling(requests, self.setup.params, slots, None)
        sampler.cost.add(out, time.perf_counter() - start)
        return out

    def rollout(
        self, problems: list[Problem], draw_prompts: Callable[[int], list[Problem]] | None = None
    ) -> tuple[GradedGroups, dict[str, float]]:
        sampler, size = self.setup.sampler, self.options.size
        prompt_ids = sampler.encode(problems)
        seeds = [draw_seed(self.setup.generator) % (2**31 - 1) for _ in problems]
        placed: list[dict[int, Any]] = [{} for _ in problems]  # response index -> completion
        rounds = [self.queue(problems)] if self.options.refill else self.schedule(problems)
        row_cap = self.options.max_sequences or size * len(problems)
        slots = used = 0
        for round_ in rounds:
            index = [(p, k) for p, start in round_ for k in range(start, start + size)]
            requests = [GenerationRequest(prompt_ids=prompt_ids[p], n=1, seed=sample_seed(seeds[p], k)) for p, k in index]
            out = self._decode(requests, row_cap) if self.options.refill else sampler.generate(requests, self.setup.params, None)
            lengths = []
            for (p, k), (completion,) in zip(index, out):
                completion.request_index = p
                placed[p][k] = completion
                lengths.append(len(completion.response_ids))
            # slot-steps the call held: its steps x its rows (a round: its longest response x its rows)
            slots += refill_steps(lengths, row_cap) * min(row_cap, len(lengths)) if self.options.refill else max(lengths) * len(lengths)
            used += sum(lengths)
        groups = [[group[k] for k in sorted(group)] for group in placed]
        if self.options.length_aware:
            for problem, group in zip(problems, groups):
                self.lengths[problem.uid] = sum(len(c.response_ids) for c in group) / len(group)
        metrics = {"micro_group_rounds": float(len(rounds)), "micro_group_padding": 1.0 - used / slots if slots else 0.0}
        return sampler.grade(problems, groups, self.setup.params.max_new_tokens), metrics
