"""Experience replay: a buffer of verified successes and the ``rollout=replay`` strategy that mixes them
into the step's groups.

:class:`ReplayBuffer` keeps correct responses per question (capacity in responses, the oldest leaves
first), each with the policy version that sampled it and its sampling log-probs (the behaviour policy
mu), the latest fresh accuracy of every question it holds, and the questions retired as solved. It
draws questions (uniformly, or weighted by accuracy bucket) and trajectories (at random, or the lowest
mean token entropy under the current policy first) from its own random stream, and saves all of it with
``state_dict``.

By default (``behaviour: stored``) a replayed response enters its group as off-policy in every token
(``behaviour="replay"``, its stored ``policy_version`` is older than the step's): the trainer takes
pi_old from its stored log-probs, so its ratio is pi_theta / mu (rlbench.training.step.behaviour_old_logp),
never a silent 1. ``behaviour: recomputed`` is the rule of RLEP's released code and of AR3PO (which
rlbench/rollout/guided/adaptive.py follows): the replayed tokens are declared on-policy (``off_policy`` all 0,
label ``replay_recomputed``), so pi_old is the current policy's log-prob and the first update's ratio
is 1; the stored version is kept, so the step's ``max_staleness`` metric still shows its age.

Configuration (conf/rollout/replay.yaml; ``algorithm=rlep`` and ``algorithm=exgrpo`` select it):

    strategy: replay
    replay:
      capacity: 4096          # responses kept; the oldest inserted leaves first
      per_group: 2            # replayed responses per group
      questions: same         # same: the step's own prompts get their stored successes (RLEP)
                              # buffer: a share of the step's groups are questions drawn from the buffer, the
                              # only groups replayed into (ExGRPO); the step's own prompts stay fresh
      buffer_share: 0.5       # with questions=buffer: the share of the step's groups
      replace_fresh: false    # false: n fresh + per_group replayed; true: n - per_group fresh + per_group replayed
      weighting: uniform      # how buffer questions are drawn: uniform | accuracy_gaussian (ExGRPO's buckets)
      weight_mean: 0.5        # accuracy_gaussian: the bucket weight is N(accuracy; weight_mean, weight_std)
      weight_std: 1.0
      trajectory: random      # which stored responses: random | lowest_entropy (lowest mean token entropy under
                              # the current policy: one forward of the candidates, the engine's position_stats)
      retire_solved: false    # a question whose fresh responses are all correct leaves the buffer for good
      start_accuracy: 0.0     # replay starts (for good) at the first step whose fresh accuracy reaches this
      behaviour: stored       # stored: pi_old of a replayed token is its stored log-prob (ratio pi_theta / mu)
                              # recomputed: pi_old recomputed under the current policy (RLEP's and AR3PO's code)
      keep: correct           # correct: verified successes | all: every response, so a buffer question comes
                              # back as its whole past group (needs questions=buffer; ReMix)
      window: null            # n: only responses of the last n policy versions stay (ReMix) | null: capacity only
      pool_save: null         # path: RLEP's pool. mode=generate writes a checkpoint's verified successes there
                              # (the paper's phase 1, rlbench/guidance/generate.py); a training run with
                              # per_group: 0 writes its own rollouts' successes there after every rollout
      pool: null              # path: RLEP's second run replays only that pool (checked against the run's
                              # problems and tokenizer); nothing enters the buffer online
      pool_per_question: 16   # pool_save: the most verified successes kept per question (a training run: the newest)

When the buffer holds fewer responses or questions than asked, the step uses what there is (fresh
prompts take the place of missing buffer questions, a group gets fewer replayed responses); the
shortfall is logged once and counted in the metric ``replay_shortfall``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from rlbench.config.schema import RolloutConfig
from rlbench.dataset import load_problems
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.rollout.engines.base import Completion
from rlbench.rollout.groups import GradedGroups
from rlbench.rollout.guided.replay_pool import (
    SuccessPool,
    check_pool_questions,
    check_pool_tokenizer,
    read_pool,
)
from rlbench.rollout.strategy import (
    RolloutSetup,
    RolloutStrategy,
    register_strategy,
    strategy_options,
)
from rlbench.utils import STREAM_REPLAY

log = logging.getLogger(__name__)

QUESTION_MODES = ("same", "buffer")
WEIGHTINGS = ("uniform", "accuracy_gaussian")
TRAJECTORY_CHOICES = ("random", "lowest_entropy")
BEHAVIOURS = ("stored", "recomputed")
KEEP_CHOICES = ("correct", "all")


@dataclass
class ReplayItem:
    """One stored response: its question, tokens, the behaviour policy's log-probs and version."""

    uid: str
    prompt_ids: tuple[int, ...]
    response_ids: list[int]
    logprobs: list[float]
    finished: bool
    text: str
    policy_version: int

    @staticmethod
    def from_completion(uid: str, completion: Completion, policy_version: int | None = None) -> "ReplayItem":
        """``policy_version``: the version to record when the step has not stamped the completion yet
        (RLEP's pool records the rollout's index)."""
        version = completion.policy_version if policy_version is None else policy_version
        if version is None:
            raise ValueError("a response enters the replay buffer only after the step stamped its policy version")
        behaviour = completion.logprobs if completion.behaviour_logprobs is None else completion.behaviour_logprobs
        return ReplayItem(uid, tuple(completion.prompt_ids), list(completion.response_ids), list(behaviour),
                          bool(completion.finished), completion.text, int(version))

    def completion(self, request_index: int, recompute: bool = False) -> Completion:
        """The stored response as a Completion for a group. ``recompute``: its tokens are declared
        on-policy (off_policy all 0, label ``replay_recomputed``), so pi_old is recomputed under the
        current policy (RLEP's and AR3PO's rule); otherwise (label ``replay``) the stored version makes
        every token off-policy with pi_old = mu."""
        return Completion(
            request_index, self.prompt_ids, list(self.response_ids), list(self.logprobs), self.finished,
            text=self.text, behaviour="replay_recomputed" if recompute else "replay", policy_version=self.policy_version,
            off_policy=[0] * len(self.response_ids) if recompute else None,
        )


def bucket_weight(accuracy: float, mean: float, std: float) -> float:
    """ExGRPO's bucket weight (Zhan et al. 2025, arXiv:2510.02245, section 3.2): the Gaussian density
    N(accuracy; mean, std) up to its constant, so mid-accuracy questions are replayed most."""
    return math.exp(-0.5 * ((accuracy - mean) / std) ** 2)


class ReplayBuffer:
    """Correct responses per question, with capacity, question weighting, trajectory choice and
    retirement (module docstring). Deterministic for a seed; ``state_dict`` holds everything."""

    def __init__(self, capacity: int, seed: int, weighting: str = "uniform", weight_mean: float = 0.5,
                 weight_std: float = 1.0, trajectory: str = "random", retire_solved: bool = False,
                 keep: str = "correct", window: int | None = None):
        self.capacity, self.weighting, self.trajectory = int(capacity), weighting, trajectory
        self.keep, self.window = keep, window
        self.weight_mean, self.weight_std, self.retire_solved = float(weight_mean), float(weight_std), bool(retire_solved)
        self.rng = np.random.default_rng([int(seed), STREAM_REPLAY])
        self.items: list[ReplayItem] = []  # oldest first
        self.accuracy: dict[str, float] = {}  # latest fresh accuracy of each question seen
        self.problems: "OrderedDict[str, Problem]" = OrderedDict()
        self.retired: set[str] = set()

    # -- insertion and retirement

    def observe(self, problem: Problem, completions: Sequence[Completion], correct: Sequence[bool]) -> None:
        """Record a question's fresh responses: its accuracy, its correct responses (every response with
        ``keep="all"``) unless retired; with ``retire_solved``, a question whose responses are all
        correct is retired. With a ``window``, responses more than ``window`` policy versions older
        than the newest one stored leave the buffer."""
        uid = problem.uid
        if uid in self.retired or not completions:
            return
        self.accuracy[uid] = sum(bool(c) for c in correct) / len(correct)
        if self.retire_solved and all(correct):
            self.retire(uid)
            return
        for completion, ok in zip(completions, correct):
            if ok or self.keep == "all":
                self.items.append(ReplayItem.from_completion(uid, completion))
                self.problems[uid] = problem
        excess = len(self.items) - self.capacity
        if excess > 0:
            del self.items[:excess]
            self._forget_empty_questions()
        if self.window is not None and self.items:
            newest = max(item.policy_version for item in self.items)
            self.items = [item for item in self.items if newest - item.policy_version < self.window]
            self._forget_empty_questions()

    def load_pool(self, questions: dict[str, dict[str, Any]]) -> None:
        """RLEP's phase 2: hold exactly the pool's successes (rlbench/rollout/guided/replay_pool.py), each
        with policy version -1 (sampled before this run's first step), and each question's pool accuracy;
        capacity does not apply (nothing is inserted online)."""
        self.items = [ReplayItem(**{**item, "uid": uid, "prompt_ids": tuple(item["prompt_ids"]), "policy_version": -1})
                      for uid, entry in questions.items() for item in entry["responses"]]
        self.problems = OrderedDict((uid, Problem(uid, entry["prompt"], entry["answer"], dict(entry["meta"]))) for uid, entry in questions.items())
        self.accuracy = {uid: float(entry["accuracy"]) for uid, entry in questions.items()}

    def retire(self, uid: str) -> None:
        self.retired.add(uid)
        self.items = [item for item in self.items if item.uid != uid]
        self._forget_empty_questions()

    def _forget_empty_questions(self) -> None:
        held = {item.uid for item in self.items}
        for uid in [u for u in self.problems if u not in held]:
            del self.problems[uid]

    # -- sampling

    def __len__(self) -> int:
        return len(self.items)

    def stored(self, uid: str) -> list[ReplayItem]:
        return [item for item in self.items if item.uid == uid]

    def question_probabilities(self, exclude: Iterable[str] = ()) -> dict[str, float]:
        """The probability of each held question (not in ``exclude``) on one draw. uniform: equal;
        accuracy_gaussian (ExGRPO, arXiv:2510.02245, section 3.2): only questions whose latest fresh
        accuracy is above 0 are eligible (a question that fails every fresh response now is left out
        though its old successes stay), and a bucket (questions of equal latest accuracy) is drawn with probability
        proportional to :func:`bucket_weight` of its accuracy among the non-empty buckets, then a
        question uniformly inside it."""
        excluded = set(exclude)
        uids = [uid for uid in self.problems if uid not in excluded]
        if self.weighting == "accuracy_gaussian":  # ExGRPO's eligible questions: 0 < k correct (k = n: retired)
            uids = [uid for uid in uids if self.accuracy[uid] > 0]
        if not uids:
            return {}
        if self.weighting == "uniform":
            return {uid: 1.0 / len(uids) for uid in uids}
        buckets: dict[float, list[str]] = {}
        for uid in uids:
            buckets.setdefault(self.accuracy[uid], []).append(uid)
        weights = {acc: bucket_weight(acc, self.weight_mean, self.weight_std) for acc in buckets}
        total = sum(weights.values())
        return {uid: weights[acc] / total / len(members) for acc, members in buckets.items() for uid in members}

    def sample_questions(self, count: int, exclude: Iterable[str] = ()) -> list[Problem]:
        """Up to ``count`` distinct held questions, drawn without replacement by
        :meth:`question_probabilities` (fewer when the buffer holds fewer)."""
        probs = self.question_probabilities(exclude)
        take = min(count, len(probs))
        if take <= 0:
            return []
        uids = list(probs)
        p = np.array([probs[u] for u in uids], dtype=np.float64)
        chosen = self.rng.choice(len(uids), size=take, replace=False, p=p / p.sum())
        return [self.problems[uids[i]] for i in chosen]

    def sample_trajectories(self, uid: str, count: int, entropies: Sequence[float] | None = None) -> list[ReplayItem]:
        """Up to ``count`` stored responses of question ``uid``: a random subset, or with
        ``lowest_entropy`` (ExGRPO, arXiv:2510.02245, section 3.2) the ones of lowest mean token entropy
        under the current policy first (ties: the older first). ``entropies``: that entropy of each of
        :meth:`stored` ``(uid)`` in order (:func:`policy_entropies`); needed only when there is a choice
        (more stored responses than ``count``)."""
        stored = self.stored(uid)
        take = min(count, len(stored))
        if take <= 0:
            return []
        if self.trajectory == "lowest_entropy":
            if take == len(stored):
                return stored
            if entropies is None or len(entropies) != len(stored):
                raise ValueError(f"trajectory=lowest_entropy ranks the {len(stored)} stored responses of question "
                                 f"{uid} by the current policy's entropy: pass one entropy per stored response")
            order = sorted(range(len(stored)), key=lambda i: entropies[i])
            return [stored[i] for i in order[:take]]
        return [stored[i] for i in sorted(self.rng.choice(len(stored), size=take, replace=False).tolist())]

    # -- checkpoints

    def state_dict(self) -> dict[str, Any]:
        return {
            "items": [dataclasses.asdict(item) for item in self.items],
            "accuracy": dict(self.accuracy),
            "problems": [dataclasses.asdict(problem) for problem in self.problems.values()],
            "retired": sorted(self.retired),
            "rng": self.rng.bit_generator.state,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.items = [ReplayItem(**{**item, "prompt_ids": tuple(item["prompt_ids"])}) for item in state["items"]]
        self.accuracy = dict(state["accuracy"])
        self.problems = OrderedDict((p["uid"], Problem(**p)) for p in state["problems"])
        self.retired = set(state["retired"])
        self.rng.bit_generator.state = state["rng"]


@dataclass(frozen=True)
class ReplayOptions:
    """The ``rollout.replay`` block (module docstring)."""

    capacity: int = 4096
    per_group: int = 2
    questions: str = "same"
    buffer_share: float = 0.5
    replace_fresh: bool = False
    weighting: str = "uniform"
    weight_mean: float = 0.5
    weight_std: float = 1.0
    trajectory: str = "random"
    retire_solved: bool = False
    start_accuracy: float = 0.0
    behaviour: str = "stored"
    keep: str = "correct"
    window: int | None = None
    pool_save: str | None = None
    pool: str | None = None
    pool_per_question: int = 16

    @classmethod
    def from_config(cls, rollout: RolloutConfig) -> "ReplayOptions":
        options = strategy_options(rollout, "replay", cls)
        n = int(rollout.n)
        checks = [
            (options.capacity >= 1, f"rollout.replay.capacity must be >= 1, got {options.capacity}"),
            (options.per_group >= 0, f"rollout.replay.per_group must be >= 1, got {options.per_group}"),
            (options.per_group >= 1 or options.pool_save is not None,
             ("rollout.replay.per_group=0 replays nothing: it is RLEP's first run (rollout=replay_rlep_collect), which "
              "writes its verified successes to a pool file: set rollout.replay.pool_save=<file>")),
            (options.pool is None or options.pool_save is None,
             ("rollout.replay.pool (RLEP's second run replays a pool) and pool_save (the first run writes one) "
              "are two runs: set one of them")),
            (options.pool_per_question >= 1, f"rollout.replay.pool_per_question must be >= 1, got {options.pool_per_question}"),
            (options.questions in QUESTION_MODES, f"rollout.replay.questions={options.questions!r}: choose one of {QUESTION_MODES}"),
            (0 < options.buffer_share <= 1, f"rollout.replay.buffer_share must be in (0, 1], got {options.buffer_share}"),
            (options.weighting in WEIGHTINGS, f"rollout.replay.weighting={options.weighting!r}: choose one of {WEIGHTINGS}"),
            (options.behaviour in BEHAVIOURS, f"rollout.replay.behaviour={options.behaviour!r}: choose one of {BEHAVIOURS}"),
            (0 <= options.start_accuracy <= 1, f"rollout.replay.start_accuracy must be in [0, 1], got {options.start_accuracy}"),
            (options.weight_std > 0, f"rollout.replay.weight_std must be > 0, got {options.weight_std}"),
            (options.trajectory in TRAJECTORY_CHOICES, f"rollout.replay.trajectory={options.trajectory!r}: choose one of {TRAJECTORY_CHOICES}"),
            (options.keep in KEEP_CHOICES, f"rollout.replay.keep={options.keep!r}: choose one of {KEEP_CHOICES}"),
            (options.window is None or options.window >= 1, f"rollout.replay.window must be >= 1 or null, got {options.window}"),
            (options.keep == "correct" or options.questions == "buffer",
             "rollout.replay.keep=all replays whole past groups as buffer questions: it needs questions=buffer"),
            (not options.replace_fresh or options.per_group < n or (options.keep == "all" and options.per_group == n),
             f"rollout.replay.replace_fresh keeps rollout.n={n} responses per group with per_group={options.per_group} "
             "of them replayed: per_group must be < rollout.n (at least one fresh response), or = rollout.n with "
             "keep=all (a whole past group)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        if options.pool is not None:
            read_pool(options.pool)
        return options

    def make_buffer(self, seed: int) -> ReplayBuffer:
        return ReplayBuffer(self.capacity, seed, self.weighting, self.weight_mean, self.weight_std,
                            self.trajectory, self.retire_solved, self.keep, self.window)


def policy_entropies(engine: Any, params: Any, candidates: dict[str, list[ReplayItem]]) -> dict[str, list[float]]:
    """The mean token entropy of each candidate response under the current policy's sampling
    distribution (ExGRPO's trajectory choice, arXiv:2510.02245, section 3.2: the replayed success is
    the one of lowest entropy under the policy about to be updated): one forward over all candidates,
    the engine's :meth:`~rlbench.rollout.engines.base.RolloutEngine.position_stats` (the forward the
    branching strategies read entropies from), whose weights are the current policy's at rollout time.
    ``candidates``: question uid -> its stored responses; the result lists theirs in the same order
    (an empty response: 0)."""
    items = [(uid, item) for uid, stored in candidates.items() for item in stored]
    if not items:
        return {}
    stats = engine.position_stats([(item.prompt_ids, tuple(item.response_ids)) for _, item in items], params)
    out: dict[str, list[float]] = {uid: [] for uid in candidates}
    for (uid, item), stat in zip(items, stats):
        out[uid].append(float(stat.entropy.double().sum()) / max(len(item.response_ids), 1))
    return out


def check_pool_problems(path: str | None, key: str, dataset: Any, seed: int, data_dir: str | None, source: str) -> None:
    """A pool file (RLEP's ``rollout.replay.pool``, DART's ``rollout.difficulty_adaptive.pool``; None: none), before
    the model loads: its questions must be the training problems of this run (``dataset``: its spec, loaded as
    the run loads it; rlbench.rollout.guided.replay_pool.check_pool_questions)."""
    if path is not None:
        check_pool_questions(path, load_problems(dataset, seed=seed, data_dir=data_dir, source=source), key)


def check_replay_pool(rollout: RolloutConfig, dataset: Any, seed: int, data_dir: str | None, source: str) -> None:
    """RLEP's second run (``rollout.replay.pool``): :func:`check_pool_problems`."""
    if rollout.strategy == "replay":
        check_pool_problems(ReplayOptions.from_config(rollout).pool, "rollout.replay.pool", dataset, seed, data_dir, source)


def check_pool_prompts(where: str, problems: Sequence[Problem], groups: Sequence[Sequence[Completion]],
                       fresh_counts: Sequence[int]) -> None:
    """A pool response (``groups[g][fresh_counts[g]:]``) sampled under another prompt than the fresh responses of its
    group (another prompt template or chat template when the pool was collected) would train on text the policy
    never saw there: refused. ``where``: the pool option and file, for the message."""
    for problem, group, count in zip(problems, groups, fresh_counts):
        if count == 0:
            continue
        prompt = tuple(group[0].prompt_ids)
        if any(tuple(c.prompt_ids) != prompt for c in group[count:]):
            raise ConfigError(f"{where}: question {problem.uid} was sampled under another prompt than this run "
                              "renders (dataset.prompt or the chat template differ): collect the pool with this "
                              "run's prompt")


def generated_pool_path(rollout: RolloutConfig) -> str | None:
    """``mode=generate`` with ``rollout=replay_rlep_collect rollout.replay.pool_save=<file>``: the pool file that
    RLEP's sampling of a checkpoint writes instead of traces (rlbench.guidance.generate); None otherwise."""
    if rollout.strategy != "replay":
        return None
    return ReplayOptions.from_config(rollout).pool_save


class StoredSuccesses(RolloutStrategy):
    """Base of a strategy that stores its correct fresh responses and injects them into groups without
    a success (AR3PO's reuse, DART's injection): ``self.buffer`` and ``self.pending``, saved with
    checkpoints."""

    def keep_successes(self, capacity: int, seed: int) -> None:
        self.buffer = ReplayBuffer(capacity, seed, trajectory="random")
        self.pending = PendingInsertions()

    def state_dict(self) -> dict[str, Any]:
        self.pending.flush(self.buffer)
        return {"buffer": self.buffer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer.load_state_dict(state["buffer"])
        self.pending = PendingInsertions()


def inject_successes(buffer: ReplayBuffer, problems: Sequence[Problem], groups: list[list[Completion]],
                     wanted: Sequence[int], recompute: bool) -> int:
    """Append to ``groups[i]`` up to ``wanted[i]`` stored responses of ``problems[i]``'s question
    (:meth:`ReplayBuffer.sample_trajectories`, in prompt order; none drawn where ``wanted[i]`` is 0)
    as Completions (:meth:`ReplayItem.completion` with ``recompute``). Returns how many were added.
    AR3PO's response reuse and DART's success injection: a group without a correct response gets one."""
    added = 0
    for i, (problem, count) in enumerate(zip(problems, wanted)):
        stored = buffer.sample_trajectories(problem.uid, count) if count > 0 else []
        groups[i].extend(item.completion(i, recompute) for item in stored)
        added += len(stored)
    return added


def fresh_results(problems: Sequence[Problem], graded: GradedGroups,
                  fresh_counts: Sequence[int]) -> list[tuple[Problem, list[Completion], list[bool]]]:
    """Each group's fresh responses (the first ``fresh_counts[g]`` of group g; replayed ones follow them
    and are never stored again) with whether the grader marked each correct."""
    correct = graded.correct.tolist()
    out, start = [], 0
    for problem, group, count in zip(problems, graded.groups, fresh_counts):
        out.append((problem, group[:count], [c > 0 for c in correct[start : start + count]]))
        start += len(group)
    return out


class PendingInsertions:
    """Fresh responses wait here until the step that sampled them has stamped their policy version;
    the next rollout moves them into the buffer (so a step never replays its own responses)."""

    def __init__(self) -> None:
        self.entries: list[tuple[Problem, list[Completion], list[bool]]] = []

    def add_groups(self, problems: Sequence[Problem], graded: GradedGroups, fresh_counts: Sequence[int]) -> None:
        """Queue the fresh responses of each group with their correctness (:func:`fresh_results`)."""
        self.entries.extend(fresh_results(problems, graded, fresh_counts))

    def flush(self, buffer: ReplayBuffer) -> None:
        for problem, completions, correct in self.entries:
            buffer.observe(problem, completions, correct)
        self.entries = []


class ShortfallLog:
    """Warns once per run when the buffer serves less than asked."""

    def __init__(self, what: str) -> None:
        self.what, self.warned = what, False

    def note(self, missing: int, detail: str) -> None:
        if missing > 0 and not self.warned:
            self.warned = True
            log.warning("%s: the buffer served %d fewer than asked (%s); using what it holds "
                        "(counted in the metric replay_shortfall)", self.what, missing, detail)


@register_strategy("replay")
class ReplaySampling(RolloutStrategy):
    """RLEP (Zhang et al. 2025, arXiv:2507.07451, section 2: fresh rollouts plus replayed verified
    successes of the same question in one group) and ExGRPO's experience mix (Zhan et al. 2025,
    arXiv:2510.02245, section 3.2: a share of the batch are buffer questions drawn by accuracy bucket,
    each with its lowest-entropy stored success beside fresh responses; solved questions retired)."""

    def __init__(self, setup: RolloutSetup, options: ReplayOptions):
        self.setup, self.options = setup, options
        self.buffer = options.make_buffer(setup.seed)
        self.pending = PendingInsertions()
        self.shortfall_log = ShortfallLog("rollout=replay")
        self.started = options.start_accuracy <= 0
        self.stopped = False  # stop_replay: on-policy from then on (ReMix's reincarnation)
        # RLEP's two phases (rlbench/rollout/guided/replay_pool.py): the first run writes its successes to a
        # pool file; the second replays that pool only, so nothing enters the buffer online
        tokenizer = setup.sampler.tokenizer
        self.collect = SuccessPool(options.pool_save, options.pool_per_question, tokenizer) if options.pool_save else None
        if options.pool is not None:
            pool = read_pool(options.pool)
            check_pool_tokenizer(options.pool, pool, tokenizer)
            self.buffer.load_pool(pool["questions"])
        elif options.questions == "same" and options.per_group > 0:
            log.warning("rollout.replay.pool is not set: the buffer fills online from this run's own successes (RLEP's "
                        "single-run variant); RLEP's second run replays a pool sampled from the first run's policy "
                        "(docs/replay.md)")

    @classmethod
    def config_options(cls, rollout: RolloutConfig) -> dict[str, Any]:
        return {"options": ReplayOptions.from_config(rollout)}

    def rollout(
        self, problems: list[Problem], draw_prompts: Callable[[int], list[Problem]] | None = None
    ) -> tuple[GradedGroups, dict[str, float]]:
        o, n = self.options, self.setup.n
        self.pending.flush(self.buffer)
        shortfall = 0
        prompts, drawn = list(problems), []
        if not self.started or self.stopped or o.per_group == 0:
            # before the accuracy threshold (the buffer fills), after stop_replay, or RLEP's first run (collects only)
            return self._fresh_only(prompts)
        if o.questions == "buffer":
            wanted = max(1, round(o.buffer_share * len(problems)))
            drawn = self.buffer.sample_questions(wanted, exclude={p.uid for p in problems})
            shortfall += wanted - len(drawn)
            self.shortfall_log.note(wanted - len(drawn), f"{len(drawn)} of {wanted} buffer questions")
            prompts = prompts[: len(prompts) - len(drawn)] + drawn
        # questions=buffer (ExGRPO, ReMix): only the buffer questions are replayed; the step's own prompts stay
        # fresh even when the buffer holds successes of theirs (ExGRPO's mix: 1 replayed + n - 1 fresh for a
        # buffer question, n fresh for a fresh one). questions=same (RLEP): every prompt gets its stored successes.
        replayed_uids = {p.uid for p in prompts if o.questions == "same"} | {p.uid for p in drawn}
        entropies = self._entropies(replayed_uids)
        replayed = [self.buffer.sample_trajectories(p.uid, o.per_group, entropies.get(p.uid))
                    if p.uid in replayed_uids else [] for p in prompts]
        wanted_replays = o.per_group * (len(drawn) if o.questions == "buffer" else len(prompts))
        missing = max(0, wanted_replays - sum(len(r) for r in replayed))
        shortfall += missing
        self.shortfall_log.note(missing, f"{wanted_replays - missing} of {wanted_replays} replayed responses")
        fresh_counts = [n - len(r) if o.replace_fresh else n for r in replayed]
        fresh = self.setup.sampler.sample(prompts, fresh_counts, self.setup.params, self.setup.generator)
        recompute = o.behaviour == "recomputed"
        groups = [group + [item.completion(i, recompute) for item in items]
                  for i, (group, items) in enumerate(zip(fresh, replayed))]
        if o.pool is not None:
            check_pool_prompts(f"rollout.replay.pool={o.pool}", prompts, groups, fresh_counts)
        graded = self.setup.sampler.grade(prompts, groups, self.setup.params.max_new_tokens)
        self._record(prompts, graded, fresh_counts)
        return graded, self._metrics(sum(len(r) for r in replayed), shortfall,
                                     sum(len(e) for e in entropies.values()))

    def _entropies(self, uids: set[str]) -> dict[str, list[float]]:
        """With ``trajectory: lowest_entropy``, the current policy's mean token entropy of the stored
        responses of each question in ``uids`` that holds more than ``per_group`` of them (the others
        have no choice to make): :func:`policy_entropies`, one forward. Otherwise nothing."""
        if self.options.trajectory != "lowest_entropy":
            return {}
        candidates = {uid: stored for uid in sorted(uids)
                      if len(stored := self.buffer.stored(uid)) > self.options.per_group}
        return policy_entropies(self.setup.sampler.engine, self.setup.params, candidates)

    def stop_replay(self) -> None:
        """From the next rollout on, fresh groups only (ReMix's switch back to on-policy training:
        rlbench.training.step.reincarnate)."""
        self.stopped = True

    def _fresh_only(self, prompts: list[Problem]) -> tuple[GradedGroups, dict[str, float]]:
        graded = self.setup.sample(prompts)
        self._record(prompts, graded, [self.setup.n] * len(prompts))
        self.started = self.started or float(graded.correct.mean().item()) >= self.options.start_accuracy
        return graded, self._metrics(0, 0, 0)

    def _record(self, prompts: list[Problem], graded: GradedGroups, fresh_counts: list[int]) -> None:
        """The fresh responses go to the buffer at the next rollout (not with a pool: RLEP's second run
        replays the pool only) and, in RLEP's first run, the verified successes to the pool file now."""
        results = fresh_results(prompts, graded, fresh_counts)
        if self.options.pool is None:
            self.pending.entries.extend(results)
        if self.collect is None:
            return
        for problem, completions, correct in results:
            if completions:
                successes = [ReplayItem.from_completion(problem.uid, c, self.collect.rollouts)
                             for c, ok in zip(completions, correct) if ok]
                self.collect.add(problem, successes, sum(correct) / len(correct))
        self.collect.write()

    def _metrics(self, replayed: int, shortfall: int, scored: int) -> dict[str, float]:
        return {
            "replay_responses": float(replayed),
            "replay_entropy_scored": float(scored),  # stored responses whose entropy the current policy gave
            "replay_shortfall": float(shortfall),
            "replay_buffer_size": float(len(self.buffer)),
            "replay_buffer_questions": float(len(self.buffer.problems)),
            "replay_retired_questions": float(len(self.buffer.retired)),
            "replay_started": float(self.started),
        }

    def state_dict(self) -> dict[str, Any]:
        self.pending.flush(self.buffer)  # after a step: every pending response is stamped
        pool = None if self.collect is None else self.collect.state_dict()
        return {"buffer": self.buffer.state_dict(), "started": self.started, "stopped": self.stopped, "pool": pool}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer.load_state_dict(state["buffer"])
        self.started = bool(state["started"])
        self.stopped = bool(state.get("stopped", False))
        self.pending = PendingInsertions()
        if self.collect is not None and state.get("pool") is not None:
            self.collect.load_state_dict(state["pool"])
