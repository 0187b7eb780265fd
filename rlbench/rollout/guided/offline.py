"""Offline training from a file of responses (``rollout=offline``): nothing is sampled; each drawn prompt's
group is its responses in the file. Two sources:

- ``rollout.offline.file=<path>``: a file of preference data, one group a record: pairs ``{prompt, chosen,
  rejected}`` (rewards 1, 0), ``{prompt, responses: [{text, reward}]}`` or rankings ``{prompt, ranking: [best, ...,
  worst]}`` (rewards by rank), as text or TRL's conversational messages, in JSONL, JSON, Parquet or CSV
  (rlbench/rollout/guided/offline_files.py reads and checks them). The file's records are the training set
  (:meth:`Offline.training_problems`); the rewards are the file's, shaped by the algorithm's reward shaping, never
  re-graded. A file of traces (``format=traces`` or
  detected) is read as the guidance library below.
- the run's guidance library (``guidance=jsonl guidance.path=<file> guidance.keep_incorrect=true``): the traces
  ``rlbench mode=generate`` writes, keyed by the dataset's uids, checked by rlbench/guidance/traces.py and graded
  by the run's grader and reward shaping like sampled responses.

With a pairwise loss (``algorithm=dpo|ipo|simpo``, docs/preference.md) the group's pairs are its responses
ordered by reward; with ``algorithm/loss=sft`` the correct ones are imitated (the offline baseline).

A library group holds at most ``rollout.n`` of the prompt's responses, taken in turn over the steps the prompt
is drawn (the per-uid counter is the strategy's state, saved with checkpoints); a file's group is its record,
whole. A drawn prompt without a response is replaced by the next prompts the sampler draws (at most
``offline.max_redraws`` per step; the replaced prompts are counted in ``offline_skipped_prompts``).
Before training, the strategy reports in one line what it read and left out (the file) or how many training
prompts have responses and how many a pair (the library), and refuses an empty set.

Every response is off-policy with behaviour log-prob 0 (mu = 1, as for guidance traces): a pairwise or
SFT loss reads no ratio; a ratio loss would train on that assumption.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rlbench.config.schema import RolloutConfig
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError, DataError
from rlbench.guidance.traces import GuidanceOptions, Trace, load_guidance, trace_completion
from rlbench.reward.math import Grade
from rlbench.rollout.groups import GradedGroups
from rlbench.rollout.guided.offline_files import TokenizedGroup, offline_groups, read_offline_file
from rlbench.rollout.strategy import RolloutSetup, RolloutStrategy, register_strategy, strategy_options

log = logging.getLogger(__name__)

FILE_BEHAVIOUR = "offline"  # the behaviour label of a file's responses (their count is the metric responses_offline)


@dataclass(frozen=True)
class OfflineOptions:
    """The ``rollout.offline`` block."""

    max_redraws: int = 64  # prompts drawn per step, at most, to replace prompts without responses
    file: str | None = None  # a file of pairs, responses or rankings (null: the run's guidance library)
    format: Literal["auto", "pairs", "responses", "ranking", "traces"] = "auto"  # auto: the first record's keys
    on_bad: Literal["stop", "skip"] = "stop"  # bad records: stop = refuse before training; skip = count, log, go on
    reference_cache: str | None = None  # a file keeping log pi_ref of the responses across runs (None: this run only)
    reference_cache_mismatch: Literal["recompute", "stop"] = "recompute"  # a cache file of another model or data: recompute | stop


def offline_options(rollout: RolloutConfig) -> OfflineOptions:
    options = strategy_options(rollout, "offline", OfflineOptions)
    if options.max_redraws < 0:
        raise ConfigError(f"rollout.offline.max_redraws must be >= 0, got {options.max_redraws}")
    if options.file is None and options.format not in ("auto", "traces"):
        raise ConfigError(f"rollout.offline.format={options.format} reads rollout.offline.file=<path>, which is not set")
    return options


def library_coverage(traces: dict[str, list[Trace]]) -> tuple[int, int]:
    """(prompts with a response, prompts with a pair: two responses with different rewards)."""
    with_pair = sum(1 for ts in traces.values() if len({t.reward for t in ts}) > 1)
    return sum(1 for ts in traces.values() if ts), with_pair


def file_digest(path: str) -> str:
    """The sha256 of the file's bytes (a resumed run checks that its file is the one it started with)."""
    digest = hashlib.sha256()
    with Path(path).expanduser().open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_grade(reward: float) -> Grade:
    """A file's label as a grade: its reward, correct when it is the top reward 1 (a pair's chosen, a ranking's
    best, a 0/1 response's 1)."""
    return Grade(correct=reward >= 1.0, extracted=None, reward=float(reward), format_ok=True)


@register_strategy("offline")
class Offline(RolloutStrategy):
    def __init__(self, setup: RolloutSetup, max_redraws: int = 64, file: str | None = None, format: str = "auto",
                 on_bad: str = "stop"):
        self.setup, self.max_redraws = setup, max_redraws
        self.file, self.format, self.on_bad = file, format, on_bad
        self.uses: dict[str, int] = {}  # uid -> responses of it used so far (the library's groups)
        self.library = setup.guidance
        self.file_groups: dict[str, TokenizedGroup] | None = None  # uid -> group, set by training_problems (a file)
        self.file_digest: str | None = None  # the file's sha256, saved with checkpoints
        self.problems: list[Problem] = []  # the training problems (set by training_problems)
        if file is None:
            self.check_library()

    def check_library(self) -> None:
        """Log the library's coverage; refuse an empty one."""
        library = self.library
        if library is None or len(library) == 0:
            raise DataError(
                "rollout=offline trains on the responses of the run's guidance library, which is empty: set "
                "rollout.offline.file=<file>, or guidance=jsonl guidance.path=<file> (rlbench mode=generate writes one) "
                "and guidance.keep_incorrect=true"
            )
        with_responses, with_pair = library_coverage(library.traces)
        log.info("rollout=offline: %d prompts have responses in the library, %d of them a pair (different rewards)",
                 with_responses, with_pair)
        if with_pair == 0:
            log.warning("rollout=offline: no prompt has two responses with different rewards: a pairwise loss "
                        "trains on nothing (guidance.keep_incorrect=true keeps the incorrect ones)")

    @classmethod
    def config_options(cls, rollout: RolloutConfig) -> dict[str, Any]:
        options = offline_options(rollout)
        return {"max_redraws": options.max_redraws, "file": options.file, "format": options.format, "on_bad": options.on_bad}

    @classmethod
    def validate(cls, rollout: RolloutConfig, advantage: str) -> None:
        """The options, and a file's checks that need no tokenizer (before the model loads): its format, missing
        fields, empty responses, texts labelled two ways, records without a pair, an empty set."""
        options = offline_options(rollout)
        if options.file is not None:
            source = read_offline_file(options.file, options.format)
            if source.format != "traces":
                source.check(options.on_bad)

    def training_problems(self, problems: list[Problem]) -> list[Problem]:
        """With a file: its groups' problems (one per kept record), after every check, reported in one line
        (DataError for an empty set, or for bad records under ``on_bad=stop``). A traces file becomes the
        run's library for ``problems``."""
        self.problems = problems
        if self.file is None:
            return problems
        source = read_offline_file(self.file, self.format)
        sampler = self.setup.sampler
        if source.format == "traces":
            options = GuidanceOptions(source="jsonl", path=self.file, keep_incorrect=True, on_bad=self.on_bad)
            self.library = load_guidance(options, problems, sampler.tokenizer, sampler.grader, self.setup.params.max_new_tokens)
            self.file = None  # from here on, the library's path
            self.check_library()
            return problems
        groups = offline_groups(source, problems, sampler.tokenizer, self.setup.params.max_new_tokens)
        source.check(self.on_bad)
        (log.warning if source.bad else log.info)("%s", source.summary())
        self.file_groups = {g.problem.uid: g for g in groups}
        self.file_digest = file_digest(self.file)
        return [g.problem for g in groups]

    def dataset(self, sampler: Any) -> GradedGroups:
        """Every group of the fixed data set at once, graded (a library) or shaped (a file) by ``sampler``, without
        moving the steps' turns over the library: what a critic trained before the actor learns from
        (algorithm.step_critic, rlbench/training/step_critic.py)."""
        if self.file_groups is not None:
            return self.file_rollout([g.problem for g in self.file_groups.values()], sampler)
        problems = [p for p in self.problems if self.library.for_problem(p)]
        return self.library_rollout(problems, sampler, every=True)

    def state_dict(self) -> dict:
        return {"uses": dict(self.uses), **({"file_digest": self.file_digest} if self.file_groups is not None else {})}

    def load_state_dict(self, state: dict) -> None:
        """Restore the state; a file that changed since the checkpoint (its groups would be others) is refused."""
        saved = state.get("file_digest")
        if saved is not None and self.file_groups is not None and saved != self.file_digest:
            raise DataError(f"rollout.offline.file={self.file} changed since the checkpoint was written (sha256 {saved[:12]}... "
                            f"then, {self.file_digest[:12]}... now): resume with the file the run started with")
        self.uses = dict(state["uses"])

    def has_responses(self, problem: Problem) -> bool:
        if self.file_groups is not None:
            return problem.uid in self.file_groups
        return bool(self.library.for_problem(problem))

    def responses(self, problem: Problem) -> list[Trace]:
        """The next ``rollout.n`` library responses of ``problem`` (in turn over the steps; all when it has fewer)."""
        traces = self.library.for_problem(problem)
        if len(traces) <= self.setup.n:
            return list(traces)
        start = self.uses.get(problem.uid, 0)
        self.uses[problem.uid] = start + self.setup.n
        return [traces[(start + i) % len(traces)] for i in range(self.setup.n)]

    def rollout(
        self, problems: list[Problem], draw_prompts: Callable[[int], list[Problem]] | None = None
    ) -> tuple[GradedGroups, dict[str, float]]:
        if self.file is not None and self.file_groups is None:
            raise DataError("rollout=offline with rollout.offline.file: training_problems() reads the file before the first step")
        kept = [p for p in problems if self.has_responses(p)]
        skipped, redraws = len(problems) - len(kept), 0
        while len(kept) < len(problems) and draw_prompts is not None and redraws < self.max_redraws:
            drawn = draw_prompts(min(len(problems) - len(kept), self.max_redraws - redraws))
            redraws += len(drawn)
            found = [p for p in drawn if self.has_responses(p)]
            skipped += len(drawn) - len(found)
            kept += found
        if not kept:
            raise DataError(f"rollout=offline: none of the {len(problems) + redraws} prompts drawn this step has a response "
                            "in the file or library (rollout.offline.max_redraws bounds the draws)")
        graded = self.file_rollout(kept) if self.file_groups is not None else self.library_rollout(kept)
        return graded, {"offline_skipped_prompts": float(skipped), "offline_groups": float(len(kept))}

    def library_rollout(self, kept: list[Problem], sampler: Any = None, every: bool = False) -> GradedGroups:
        """The library's responses of ``kept`` (the step's turn of them; ``every``: all), graded by ``sampler`` (by
        default the run's)."""
        sampler = sampler or self.setup.sampler
        prompt_ids = sampler.encode(kept)
        groups = [[trace_completion(t, ids, request_index=k)
                   for t in (self.library.for_problem(p) if every else self.responses(p))]
                  for k, (p, ids) in enumerate(zip(kept, prompt_ids))]
        return sampler.grade(kept, groups, self.setup.params.max_new_tokens)

    def file_rollout(self, kept: list[Problem], sampler: Any = None) -> GradedGroups:
        """The file's groups of ``kept`` with the file's rewards (shaped, not graded), by ``sampler`` (by default
        the run's)."""
        sampler = sampler or self.setup.sampler
        prompt_ids = sampler.encode(kept)
        groups, grades = [], []
        for k, (p, ids) in enumerate(zip(kept, prompt_ids)):
            group = self.file_groups[p.uid]
            groups.append([trace_completion(Trace(p.uid, text, tokens, FILE_BEHAVIOUR), ids, request_index=k)
                           for text, tokens in zip(group.texts, group.token_ids)])
            grades += [file_grade(r) for r in group.rewards]
        return sampler.shaped(kept, groups, grades, self.setup.params.max_new_tokens)
