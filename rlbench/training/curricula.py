"""Curricula: which prompts a step trains on, and stages that change the run's settings at given steps.

* The per-prompt statistics (rlbench.training.prompt_stats.PromptStatsStore): the curriculum feeds
  it every step's graded groups; prompt samplers read it.
* Prompt samplers (``prompt_sampler=<name>``, the node ``trainer.prompt_sampler``): ``uniform`` (the default:
  shuffled passes, :class:`PromptSampler`), ``weighted`` (draw by pass rate:
  a Gaussian around a target pass rate, or easy / medium / hard bucket weights) and ``hard_focus``
  (DRIVE's stage-2 rule: after every phase, keep the hardest share of the pool; ``prompt_sampler=drive``
  switches to it in a stage), ``clpo`` (``weighted`` by CLPO's buckets plus the policy's own rewrites of its
  hard and medium problems, rlbench.training.rewrites), ``spo`` (SPO's draw by the value tracker's uncertainty, seeded from the
  initial policy). LSPO's length filter works on a step's own rollouts, so it is a rollout
  (``rollout=lspo``, rlbench/rollout/strategies/dynamic_sampling.py), not a sampler. Each has
  ``next(count)``, ``state_dict()`` and ``load_state_dict()``; a new one is a class registered with
  :func:`register_prompt_sampler` and a YAML in conf/prompt_sampler/.
* Filters before training: ``trainer.difficulty_filter`` (INTELLECT-2's offline filter by the initial
  policy's, or another model's, pass rate, :func:`difficulty_filter`), run by the loop (rlbench.training.loop) before step 1.
* Stages (``trainer.stages``, parsed by rlbench.training.stages): from step ``at`` on, the listed
  settings change; :meth:`Curriculum.prompts` enters a stage at its step (:func:`apply_stage`), and a
  stage naming a sampler switches to it (DRIVE: ``prompt_sampler=drive``, uniform then hard_focus).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlbench.algorithm.advantages import SPOTracker
from rlbench.config.schema import (
    DifficultyFilterConfig,
    PromptSamplerConfig,
    TrainerConfig,
)
from rlbench.config.typed import settings_block
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.rollout.groups import GradedGroups
from rlbench.training.aux_tasks import AuxTaskBuffer, aux_count, dataset_groups
from rlbench.training.distributed import SINGLE, World
from rlbench.training.prompt_stats import PromptStatsStore, measure_before_training
from rlbench.training.rewrites import ACCEPTANCE, BUCKETS, PolicyRewriter, RewritePool, difficulty_bucket
from rlbench.training.stages import SAMPLER_KEY, MetricHistory, Stage, parse_stages
from rlbench.training.step import StepContext
from rlbench.training.swarm import own_groups
from rlbench.utils import STREAM_CURRICULUM, STREAM_DATA_ORDER, Progress, make_generator

log = logging.getLogger(__name__)

# -------------------------------------------------------------------------------------- samplers

PROMPT_SAMPLERS: dict[str, type] = {}


def register_prompt_sampler(name: str) -> Callable[[type], type]:
    def register(cls: type) -> type:
        PROMPT_SAMPLERS[name] = cls
        return cls

    return register


def sampler_options(sampler: PromptSamplerConfig | None) -> tuple[type, Any]:
    """The sampler class named by ``trainer.prompt_sampler.name`` and its options (the block
    ``trainer.prompt_sampler.<name>``); ConfigError for an unknown name or key. None: the schema's default."""
    sampler = sampler or PromptSamplerConfig()
    name = sampler.name
    if name not in PROMPT_SAMPLERS:
        raise ConfigError(f"trainer.prompt_sampler.name={name!r} is unknown; choose one of {sorted(PROMPT_SAMPLERS)} (conf/prompt_sampler/)")
    cls = PROMPT_SAMPLERS[name]
    if cls.Options is None:
        return cls, None
    options = settings_block(sampler.settings.get(name), cls.Options, f"trainer.prompt_sampler.{name}")
    options.check()
    return cls, options


def make_prompt_sampler(sampler: PromptSamplerConfig | None, problems: list[Problem], seed: int, stats: PromptStatsStore):
    cls, options = sampler_options(sampler)
    return cls.build(problems, seed, stats, options)


def shuffled_passes(problems: list[Problem], order: list[int], rng: np.random.Generator, count: int) -> list[Problem]:
    """``count`` problems from shuffled passes: ``order`` is what is left of the current pass (consumed
    in place from its end), refilled with a new permutation when it runs out."""
    batch = []
    while len(batch) < count:
        if not order:
            order.extend(rng.permutation(len(problems)).tolist())
        batch.append(problems[order.pop()])
    return batch


@register_prompt_sampler("uniform")
class PromptSampler:
    """The default: shuffled passes over the training problems; the order is a function of the seed alone."""

    Options = None  # no settings block

    def __init__(self, problems: list[Problem], seed: int):
        self.problems = problems
        self.rng = np.random.default_rng([seed, STREAM_DATA_ORDER])
        self.order: list[int] = []

    @classmethod
    def build(cls, problems: list[Problem], seed: int, stats: PromptStatsStore, options: None) -> PromptSampler:
        return cls(problems, seed)

    def next(self, count: int) -> list[Problem]:
        return shuffled_passes(self.problems, self.order, self.rng, count)

    def state_dict(self) -> dict[str, Any]:
        """The position in the order: the generator's state and what is left of the current pass."""
        return {"rng": self.rng.bit_generator.state, "order": list(self.order)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.order = [int(i) for i in state["order"]]


@dataclass(frozen=True)
class WeightedOptions:
    """``trainer.prompt_sampler.weighted``: how a prompt's pass rate p becomes its draw weight."""

    weighting: str = "gaussian"  # gaussian: exp(-((p - target) / width)^2 / 2) | buckets
    target: float = 0.5
    width: float = 0.25
    prior: float = 0.5  # the pass rate assumed for a prompt not seen yet
    hard_below: float = 0.2  # buckets: p <= hard_below is hard, p >= easy_above is easy, else medium
    easy_above: float = 0.8
    easy_strict: bool = False  # true: p = easy_above is medium (easy is p > easy_above)
    hard_weight: float = 1.0
    medium_weight: float = 1.0
    easy_weight: float = 0.25

    def check(self) -> None:
        if self.weighting not in ("gaussian", "buckets"):
            raise ConfigError(f"trainer.prompt_sampler.weighted.weighting={self.weighting!r}: choose gaussian or buckets")
        if self.width <= 0 or not 0 <= self.prior <= 1 or not 0 <= self.hard_below < self.easy_above <= 1:
            raise ConfigError("trainer.prompt_sampler.weighted: width > 0, prior in [0, 1] and 0 <= hard_below < easy_above <= 1 are required")
        if min(self.hard_weight, self.medium_weight, self.easy_weight) < 0 or max(self.hard_weight, self.medium_weight, self.easy_weight) == 0:
            raise ConfigError("trainer.prompt_sampler.weighted: bucket weights must be >= 0 and not all 0")

    def weight(self, pass_rate: float) -> float:
        p = self.prior if math.isnan(pass_rate) else pass_rate
        if self.weighting == "gaussian":
            return math.exp(-0.5 * ((p - self.target) / self.width) ** 2)
        return {"hard": self.hard_weight, "medium": self.medium_weight, "easy": self.easy_weight}[self.bucket(p)]

    def bucket(self, pass_rate: float) -> str:
        """The difficulty bucket of a pass rate (rlbench.training.rewrites.difficulty_bucket)."""
        return difficulty_bucket(pass_rate, self.hard_below, self.easy_above, self.easy_strict)


@register_prompt_sampler("weighted")
class WeightedPrompts:
    """Prompts drawn without replacement within a step, with probability proportional to
    :meth:`WeightedOptions.weight` of their pass rate so far: the Gaussian form concentrates on
    prompts near a target pass rate (the mid-difficulty prompts whose groups carry signal, as
    ExGRPO's buckets do for replay, arXiv:2510.02245 section 3.2); the bucket form is CLPO's
    online difficulty buckets (arXiv:2509.25004) with easy prompts down-weighted (``prompt_sampler=clpo``
    adds CLPO's rewriting of medium / hard problems: :class:`ClpoPrompts`)."""

    Options = WeightedOptions

    def __init__(self, problems: list[Problem], seed: int, stats: PromptStatsStore, options: WeightedOptions):
        self.problems, self.stats, self.options = problems, stats, options
        self.rng = np.random.default_rng([seed, STREAM_CURRICULUM])

    @classmethod
    def build(cls, problems, seed, stats, options):
        return cls(problems, seed, stats, options)

    def probabilities(self) -> np.ndarray:
        """The probability of each problem on one draw."""
        weights = np.array([self.options.weight(self.stats.get(p.uid).pass_rate) for p in self.problems])
        if weights.sum() == 0:  # every prompt in a zero-weight bucket: fall back to uniform
            weights = np.ones(len(self.problems))
        return weights / weights.sum()

    def next(self, count: int) -> list[Problem]:
        probs = self.probabilities()
        replace = count > int((probs > 0).sum())
        chosen = self.rng.choice(len(self.problems), size=count, replace=replace, p=probs)
        return [self.problems[i] for i in chosen]

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.bit_generator.state, "stats": self.stats.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.stats.load_state_dict(state["stats"])


@dataclass(frozen=True)
class ClpoOptions(WeightedOptions):
    """``trainer.prompt_sampler.clpo``: the weighted sampler's settings (CLPO's buckets) and the rewriting's
    (rlbench.training.rewrites). The defaults are the authors' release (github.com/csuking/CLPO @ cb77b56:
    scripts/clpo_qwen3_8b.sh, verl/trainer/ppo/ray_trainer.py); rlbench's earlier rule is hard_below=0.2
    easy_above=0.8 easy_strict=false easy_weight=0.25 mixing=next_steps share=0.25 acceptance=agreement
    rewrite_tokens=128 rewrite_temperature=null show_answer=false retry_after=0."""

    weighting: str = "buckets"
    hard_below: float = 0.3  # the release's clpo_hard_acc_upper
    easy_above: float = 0.7  # the release's clpo_med_acc_upper, with easy_strict: medium is 0.3 < acc <= 0.7
    easy_strict: bool = True
    easy_weight: float = 1.0  # the release draws its data loader's order: no bucket is down-weighted
    rewrite: tuple[str, ...] = ("hard", "medium")  # the buckets rewritten: hard -> simplified, medium -> a variant
    mixing: str = "same_step"  # same_step: the accepted rewrites join this step's batch | next_steps: the pool, `share`
    share: float = 0.0  # next_steps: of each step's prompts drawn from the accepted rewrites: aux_count(share, B)
    rewrite_tokens: int = 400  # the policy's tokens for one rewrite
    rewrite_temperature: float | None = 0.7  # of the rewrite (None: the run's rollout temperature)
    show_answer: bool = True  # the rewrite prompt states the reference answer (to keep, not to reveal)
    verify_samples: int | None = None  # the policy's answers to a rewrite, graded against the origin's reference answer (None: rollout.n)
    acceptance: str = "mixed"  # mixed: kept iff 0 < correct < verify_samples | agreement: iff >= agreement of them
    agreement: float = 0.5  # acceptance=agreement: the share of correct answers needed (0: every well-formed rewrite)
    max_per_step: int = 0  # rewrites attempted per step at most (0: every designated problem of the step)
    retry_after: int = 1  # 0: a (uid, bucket) is rewritten once per run; k: again after k steps (1: whenever it is drawn)
    capacity: int = 256  # accepted rewrites kept (the oldest leave first; next_steps)

    def check(self) -> None:
        super().check()
        where = "trainer.prompt_sampler.clpo"
        if not self.rewrite or any(b not in BUCKETS[:2] for b in self.rewrite):
            raise ConfigError(f"{where}.rewrite={list(self.rewrite)}: choose one or both of ['hard', 'medium'] "
                              "(hard problems are simplified, medium ones diversified; easy ones are not rewritten)")
        if not 0 <= self.share < 1 or not 0 <= self.agreement <= 1:
            raise ConfigError(f"{where}: share in [0, 1) and agreement in [0, 1] are required, got {self.share}, {self.agreement}")
        if self.mixing not in ("same_step", "next_steps") or self.acceptance not in ACCEPTANCE:
            raise ConfigError(f"{where}: mixing is same_step or next_steps, acceptance one of {list(ACCEPTANCE)}; got "
                              f"{self.mixing!r}, {self.acceptance!r}")
        if self.mixing == "same_step" and self.share > 0:
            raise ConfigError(f"{where}.share={self.share}: with mixing=same_step the accepted rewrites join their own "
                              "step's batch and no pool is drawn; set share=0, or mixing=next_steps")
        if self.rewrite_temperature is not None and self.rewrite_temperature < 0:
            raise ConfigError(f"{where}.rewrite_temperature must be >= 0 (or null: the run's), got {self.rewrite_temperature}")
        if min(self.rewrite_tokens, 1 if self.verify_samples is None else self.verify_samples, self.capacity) < 1 or min(self.max_per_step, self.retry_after) < 0:
            raise ConfigError(f"{where}: rewrite_tokens, verify_samples (or null) and capacity >= 1, max_per_step and retry_after >= 0 are required")


@register_prompt_sampler("clpo")
class ClpoPrompts(WeightedPrompts):
    """CLPO (Zhang et al. 2025, arXiv:2509.25004, section 3): the weighted sampler over CLPO's online difficulty
    buckets, plus the policy's own rewrites of its hard and medium problems (rlbench.training.rewrites: after each
    step's rollout the policy simplifies the step's hard problems and diversifies its medium ones; a rewrite is kept
    by the answer check against the original reference answer). mixing=same_step (the release): :meth:`observe`
    returns the step's groups to train on, the accepted rewrites' among them; mixing=next_steps: each later step
    draws aux_count(share, B) of its B prompts from the accepted rewrites and the rest by weight from the dataset's
    problems. The run binds the policy (:meth:`bind`); a checkpoint keeps the pool."""

    Options = ClpoOptions

    def __init__(self, problems: list[Problem], seed: int, stats: PromptStatsStore, options: ClpoOptions):
        super().__init__(problems, seed, stats, options)
        self.pool = RewritePool(options, seed)
        self.rewriter: Any = None

    def bind(self, ctx: StepContext) -> None:
        self.rewriter = PolicyRewriter(ctx, self.options.rewrite_tokens, self.options.verify_samples,
                                       self.options.rewrite_temperature)

    def next(self, count: int) -> list[Problem]:
        rewrites = self.pool.take(aux_count(self.options.share, count))
        return super().next(count - len(rewrites)) + rewrites

    def observe(self, step: int, graded: GradedGroups) -> GradedGroups:
        return self.pool.observe(step, graded, self.rewriter)

    def metrics(self) -> dict[str, float]:
        return self.pool.metrics()

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "rewrites": self.pool.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.pool.load_state_dict(state["rewrites"])


@dataclass(frozen=True)
class HardFocusOptions:
    """``trainer.prompt_sampler.hard_focus``: DRIVE's stage-2 curriculum (arXiv:2511.06307)."""

    phase_steps: int = 8  # steps per phase; the pool is cut after each
    keep_fraction: float = 0.5  # share of the pool kept (the hardest first)
    max_pass_rate: float = 0.8  # prompts above this pass rate leave the pool
    min_pool: int = 8  # the pool never shrinks below this many prompts

    def check(self) -> None:
        if self.phase_steps < 1 or not 0 < self.keep_fraction <= 1 or not 0 <= self.max_pass_rate <= 1 or self.min_pool < 1:
            raise ConfigError("trainer.prompt_sampler.hard_focus: phase_steps >= 1, keep_fraction in (0, 1], "
                              "max_pass_rate in [0, 1] and min_pool >= 1 are required")


def hardest(pool: Sequence[Problem], stats: PromptStatsStore, options: HardFocusOptions,
            unseen: float = 0.0) -> list[Problem]:
    """The pool after one phase: prompts with pass rate <= max_pass_rate, the hardest
    ceil(keep_fraction * |pool|) of them (lowest pass rate first, ties in pool order), never fewer than
    min_pool (then the hardest of the rest). A prompt not seen yet counts as pass rate ``unseen``: 0 within
    the stage (it stays until it has been measured), inf when the pool is first cut from an earlier
    stage's measurements (:meth:`HardFocusPrompts.enter`: measured hard prompts first, unmeasured ones
    only to fill the pool)."""
    rate = lambda p: unseen if math.isnan(stats.get(p.uid).pass_rate) else stats.get(p.uid).pass_rate
    eligible = [p for p in pool if rate(p) <= options.max_pass_rate]
    keep = max(math.ceil(options.keep_fraction * len(pool)), min(options.min_pool, len(pool)))
    ranked = sorted(eligible, key=rate)
    if len(ranked) < keep:
        ranked = ranked + sorted([p for p in pool if p not in eligible], key=rate)
    kept = {id(p) for p in ranked[:keep]}
    return [p for p in pool if id(p) in kept]


@register_prompt_sampler("hard_focus")
class HardFocusPrompts:
    """Shuffled passes over a pool that starts as every problem and, after every ``phase_steps``
    steps of its own, keeps only its hardest part (:func:`hardest`); the pool never grows, so its pass
    rates only rise in difficulty (DRIVE, arXiv:2511.06307, section 3: stage 2 keeps retaining the
    hardest problems). Entered by a stage (``trainer.stages`` with ``trainer.prompt_sampler.name:
    hard_focus``, DRIVE's switch from its uniform stage 1), the pool is first cut to the hardest
    part by the pass rates measured so far (:meth:`enter`)."""

    Options = HardFocusOptions

    def __init__(self, problems: list[Problem], seed: int, stats: PromptStatsStore, options: HardFocusOptions):
        self.pool, self.stats, self.options = list(problems), stats, options
        self.rng = np.random.default_rng([seed, STREAM_CURRICULUM])
        self.order: list[int] = []
        self.started_after = 0  # the step before this sampler's first step: its phases count from there

    @classmethod
    def build(cls, problems, seed, stats, options):
        return cls(problems, seed, stats, options)

    def enter(self, step: int) -> None:
        """Called when a stage switches to this sampler at ``step``: the pool becomes the hardest part of
        every problem by the pass rates measured so far (prompts not measured only fill it up to its
        size), and its phases count from ``step``."""
        self.pool = hardest(self.pool, self.stats, self.options, unseen=math.inf)
        self.order = []
        self.started_after = step - 1

    def next(self, count: int) -> list[Problem]:
        return shuffled_passes(self.pool, self.order, self.rng, count)

    def end_step(self, step: int) -> None:
        """Called by the loop after each step: cut the pool at the end of a phase."""
        if (step - self.started_after) % self.options.phase_steps == 0:
            self.pool = hardest(self.pool, self.stats, self.options)
            self.order = []

    def state_dict(self) -> dict[str, Any]:
        return {"pool": [p.uid for p in self.pool], "order": list(self.order), "rng": self.rng.bit_generator.state,
                "stats": self.stats.state_dict(), "started_after": self.started_after}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        by_uid = {p.uid: p for p in self.pool}
        self.pool = [by_uid[uid] for uid in state["pool"]]
        self.order = list(state["order"])
        self.started_after = int(state["started_after"])
        self.rng.bit_generator.state = state["rng"]
        self.stats.load_state_dict(state["stats"])


# ----------------------------------------------------------------------- filters before training


def difficulty_filter(problems: list[Problem], sample: Callable[[list[Problem]], GradedGroups],
                      stats: PromptStatsStore, band: DifficultyFilterConfig) -> list[Problem]:
    """INTELLECT-2's offline difficulty filter (Prime Intellect Team 2025, arXiv:2505.07291: problems the base
    model solves in 8 of 8 samples are left out before training; ``trainer.difficulty_filter``): every problem
    without a reference pass rate in ``stats`` is answered by ``sample`` (``band.samples`` responses of the
    initial policy, or of ``band.model``) and its pass rate recorded there; the problems whose rate lies in [min_pass_rate, max_pass_rate]
    are returned (a resumed run's statistics hold every rate: nothing is sampled). ConfigError when none is."""
    todo = [p for p in problems if stats.get(p.uid).reference_pass_rate is None]
    for uid, (_, pass_rate) in measure_before_training(todo, sample, "difficulty filter").items():
        stats.set_reference(uid, pass_rate)
    kept = [p for p in problems if band.min_pass_rate <= stats.get(p.uid).reference_pass_rate <= band.max_pass_rate]
    log.info("difficulty filter: %d of %d training problems have an initial pass rate in [%g, %g]",
             len(kept), len(problems), band.min_pass_rate, band.max_pass_rate)
    if not kept:
        raise ConfigError(f"trainer.difficulty_filter: none of the {len(problems)} training problems has an initial pass rate "
                          f"in [{band.min_pass_rate}, {band.max_pass_rate}] ({band.samples} samples each); widen the band")
    return kept


# ------------------------------------------------------------------------------- the data side


@dataclass(frozen=True)
class TrackerPriorityOptions:
    """The ``trainer.prompt_sampler.spo`` block (conf/prompt_sampler/spo.yaml)."""

    exploration: float = 0.05  # w = sqrt(p_hat (1 - p_hat)) + exploration
    init_samples: int = 0  # responses per prompt of the initial policy that seed the tracker (0: Beta(0.5, 0.5))
    init_batch: int = 64  # prompts per sampling call of the initialisation

    def check(self) -> None:
        if self.exploration < 0 or self.init_samples < 0 or self.init_batch < 1:
            raise ConfigError(
                "trainer.prompt_sampler.spo: exploration >= 0, init_samples >= 0 and init_batch >= 1 are required, got "
                f"{self.exploration}, {self.init_samples}, {self.init_batch}"
            )


@register_prompt_sampler("spo")
class TrackerPriorityPrompts:
    """SPO's prompt sampling (Xu & Ding 2025, arXiv:2509.13232; re-implemented from the paper and the
    verl recipe's spo trainer): each step's prompts are drawn with replacement with probability
    proportional to w = sqrt(p_hat (1 - p_hat)) + ``exploration``, where p_hat is the SPO value tracker's
    success probability of the prompt (``algorithm=spo``; rlbench.algorithm.advantages.SPOTracker), so the
    prompts the tracker is least sure of come most often. With ``init_samples`` = N > 0 the tracker is
    first seeded from the initial policy: before the first step every training prompt gets N responses
    (the run's sampler and sampling settings), and its s successes (outcome rewards, in [0, 1] under spo)
    set (alpha, beta) = N_init ((s + 0.5), (N - s + 0.5)) / (N + 1) with N_init = 1 / (1 - rho_min)
    (``spo_tracker_init``). The run binds the tracker (:meth:`bind`); a checkpoint keeps the draw
    position and whether the initialisation ran (the tracker's state is saved with the advantage inputs)."""

    Options = TrackerPriorityOptions

    def __init__(self, problems: list[Problem], seed: int, options: TrackerPriorityOptions):
        self.problems, self.options, self.seed = problems, options, seed
        self.rng = np.random.default_rng([seed, STREAM_CURRICULUM])
        self.tracker: Any = None
        self.ctx: StepContext | None = None
        self.initialised = False

    @classmethod
    def build(cls, problems, seed, stats, options):
        return cls(problems, seed, options)

    def bind(self, ctx: StepContext) -> None:
        """Find the run's SPO tracker among its advantage-input sources (``algorithm=spo``)."""
        trackers = [source.tracker for source in ctx.inputs.sources if isinstance(getattr(source, "tracker", None), SPOTracker)]
        if not trackers:
            raise ConfigError("trainer.prompt_sampler=spo draws by the SPO tracker's uncertainty: it needs algorithm=spo")
        self.tracker, self.ctx = trackers[0], ctx

    def initialise(self) -> None:
        """Seed the tracker from ``init_samples`` responses of the current (initial) policy per prompt."""
        n, ctx = self.options.init_samples, self.ctx
        assert ctx is not None
        generator = make_generator(self.seed, STREAM_CURRICULUM)
        progress = Progress("spo tracker init", len(self.problems), min_interval=2.0)
        for start in range(0, len(self.problems), self.options.init_batch):
            chunk = self.problems[start : start + self.options.init_batch]
            groups = ctx.sampler.sample(chunk, n, ctx.params, generator)
            graded = ctx.sampler.grade(chunk, groups, ctx.params.max_new_tokens)
            for problem, outcomes in zip(chunk, graded.outcome.view(len(chunk), n).tolist()):
                self.tracker.initialise(problem.uid, sum(outcomes), n)
            progress.update(len(chunk))

    def probabilities(self) -> np.ndarray:
        """The probability of each problem on one draw."""
        weights = self.tracker.sampling_weights([p.uid for p in self.problems], self.options.exploration).numpy()
        if weights.sum() == 0:  # exploration 0 and every prompt certain: uniform
            weights = np.ones(len(self.problems))
        return weights / weights.sum()

    def next(self, count: int) -> list[Problem]:
        if self.tracker is None:
            raise RuntimeError("TrackerPriorityPrompts.next before bind(ctx): the run binds the SPO tracker")
        if not self.initialised:
            if self.options.init_samples:
                self.initialise()
            self.initialised = True
        chosen = self.rng.choice(len(self.problems), size=count, replace=True, p=self.probabilities())
        return [self.problems[i] for i in chosen]

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.bit_generator.state, "initialised": self.initialised}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.initialised = bool(state["initialised"])


class Curriculum:
    """The data side of the training loop: the prompt sampler, the statistics store it reads and the
    stages. Per step: :meth:`prompts` (entering a stage first), the rollout, :meth:`observe`, :meth:`end_step`.
    The synchronous loop calls them between updates, the asynchronous generator in its own thread.
    A stage with a ``trainer.prompt_sampler`` node replaces the sampler from its step on with a new one
    built from that node, which reads the same statistics; one with an ``enter(step)`` hook is told the
    step (hard_focus cuts its pool)."""

    def __init__(self, trainer: TrainerConfig, seed: int, problems: list[Problem], stats: PromptStatsStore | None = None,
                 sandbox_limits: Any = None):
        self.stats = PromptStatsStore() if stats is None else stats  # the step context's (strategies read it too)
        self.problems, self.seed = problems, seed
        self.sampler = make_prompt_sampler(trainer.prompt_sampler, problems, seed, self.stats)
        self.stages = parse_stages(trainer.stages, trainer.steps)  # entered in list order
        self.entered_at: list[int] = []  # the step each entered stage started at
        self.streak = 0                  # steps in a row the next stage's trigger has held (a `when` stage)
        self.history = MetricHistory(self.stages)  # what derived stage metrics read (entropy_change)
        self.prompts_per_step = trainer.prompts_per_step
        # trainer.aux_tasks: a share of each step's prompts from tasks built from earlier steps (SPARK)
        self.aux = None if trainer.aux_tasks is None else AuxTaskBuffer(trainer.aux_tasks, seed, sandbox_limits)

    def bind(self, ctx: StepContext) -> None:
        """Give the prompt sampler the run's step context, when it reads it (``spo``: the tracker)."""
        if hasattr(self.sampler, "bind"):
            self.sampler.bind(ctx)

    def switch_sampler(self, sampler: PromptSamplerConfig) -> None:
        """The sampler of a stage's ``trainer.prompt_sampler`` node in place of the current one."""
        self.sampler = make_prompt_sampler(sampler, self.problems, self.seed, self.stats)

    @property
    def next_stage(self) -> Stage | None:
        return self.stages[len(self.entered_at)] if len(self.entered_at) < len(self.stages) else None

    def stage_due(self, step: int) -> bool:
        """Whether the next stage starts at ``step``: its ``at``, or its trigger held long enough by the step before."""
        stage = self.next_stage
        if stage is None:
            return False
        return stage.at == step if stage.when is None else self.streak >= stage.when.for_steps

    def prompts(self, step: int, ctx: StepContext) -> list[Problem]:
        """Step ``step``'s prompts, after entering the stage that starts at it (if any)."""
        if self.stage_due(step):
            stage = self.next_stage
            apply_stage(ctx, stage)
            self.entered_at.append(step)
            self.streak = 0
            self.prompts_per_step = int(stage.changes.get("trainer.prompts_per_step", self.prompts_per_step))
            if SAMPLER_KEY in stage.changes:
                self.switch_sampler(stage.changes[SAMPLER_KEY])
                self.bind(ctx)
                if hasattr(self.sampler, "enter"):
                    self.sampler.enter(step)
        if self.aux is None:
            return self.sampler.next(self.prompts_per_step)
        tasks = self.aux.take(aux_count(self.aux.options.share, self.prompts_per_step))
        return self.sampler.next(self.prompts_per_step - len(tasks)) + tasks

    def draw(self, count: int) -> list[Problem]:
        """More prompts within a step (dynamic sampling's later rounds)."""
        return self.sampler.next(count)

    def observe(self, step: int, graded: GradedGroups, world: World = SINGLE) -> GradedGroups:
        """Count the step's groups in the statistics: the run's own dataset prompts only (a swarm actor leaves
        out the groups other actors shared, rlbench.training.swarm.own_groups; auxiliary tasks are left out),
        and build auxiliary tasks from them (trainer.aux_tasks). Returns the groups the step trains on: its own,
        or the sampler's (clpo: labelled, with the step's accepted rewrites under mixing=same_step)."""
        self.stats.observe(step, dataset_groups(own_groups(graded)), world)
        if self.aux is not None:
            self.aux.add(graded)
        if hasattr(self.sampler, "observe"):  # clpo: the policy rewrites the step's hard and medium problems
            return self.sampler.observe(step, graded)
        return graded

    def watch(self, metrics: dict[str, float]) -> None:
        """Count the step toward the next stage's trigger (a ``when`` stage): the streak of steps whose metric
        crossed the threshold, reset by a step that did not (a derived metric: from the recorded history)."""
        self.history.record(metrics)
        stage = self.next_stage
        if stage is not None and stage.when is not None:
            self.streak = self.streak + 1 if stage.when.holds(self.history.value(stage.when.metric, metrics)) else 0

    def metrics(self) -> dict[str, float]:
        """The step's data-side metrics: the auxiliary tasks' counts (trainer.aux_tasks), the sampler's (clpo),
        and with stages the number entered (``stages_entered``) and the derived metrics they watch, once finite."""
        sampler = self.sampler.metrics() if hasattr(self.sampler, "metrics") else {}
        entered = {"stages_entered": float(len(self.entered_at)), **self.history.metrics()} if self.stages else {}
        return {**sampler, **entered, **({} if self.aux is None else self.aux.metrics())}

    def end_step(self, step: int) -> None:
        if hasattr(self.sampler, "end_step"):
            self.sampler.end_step(step)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint saves: the sampler's position, the statistics, the prompts per step."""
        return {"sampler": self.sampler.state_dict(), "stats": self.stats.state_dict(),
                "prompts_per_step": self.prompts_per_step, "aux_tasks": None if self.aux is None else self.aux.state_dict(),
                "stages_entered_at": list(self.entered_at), "stage_streak": self.streak,
                "stage_history": self.history.state_dict()}

    def load_state_dict(self, state: dict[str, Any], ctx: StepContext, step: int) -> None:
        """Continue after ``step`` steps: every stage entered by then put back into the step context
        (in order, as the run entered them), the sampler in force after ``step``, and the saved state
        (a checkpoint written before ``when`` stages existed: the ``at`` stages up to ``step``)."""
        entered = state.get("stages_entered_at")
        if entered is None:
            entered = [stage.at for stage in self.stages if stage.at is not None and stage.at <= step]
        self.entered_at, self.streak = list(entered), int(state.get("stage_streak", 0))
        self.history.load_state_dict(state.get("stage_history", {}))
        for stage in self.stages[:len(self.entered_at)]:
            apply_stage(ctx, stage)
            if SAMPLER_KEY in stage.changes:
                self.switch_sampler(stage.changes[SAMPLER_KEY])
        self.sampler.load_state_dict(state["sampler"])
        self.stats.load_state_dict(state["stats"])
        self.prompts_per_step = int(state["prompts_per_step"])
        if self.aux is not None:
            self.aux.load_state_dict(state["aux_tasks"])


# ---------------------------------------------------------------------------------------- stages


def apply_stage(ctx: StepContext, stage: Stage) -> None:
    """Put a stage's rollout settings into the step context and its rollout strategy (every strategy
    keeps its RolloutSetup as ``.setup``); trainer.prompts_per_step is read by the loop."""
    changes = stage.changes
    ctx.params = dataclasses.replace(
        ctx.params,
        max_new_tokens=int(changes.get("rollout.max_new_tokens", ctx.params.max_new_tokens)),
        temperature=float(changes.get("rollout.temperature", ctx.params.temperature)),
    )
    setup = ctx.strategy.setup
    ctx.strategy.setup = dataclasses.replace(setup, n=int(changes.get("rollout.n", setup.n)), params=ctx.params)
