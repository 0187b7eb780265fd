"""The step inputs that need more than the training batch and the sampling pass (rlbench/algorithm/step_inputs.py,
producers ``source`` and ``strategy``): extra rollouts, per-prompt state across steps, the grader's extracted
answers, and what a rollout strategy's completions carry. The step (rlbench.training.step) asks
:class:`AdvantageInputSources` for them just before the advantage, and calls
:meth:`AdvantageInputSources.after_update` after the policy step.

A ``source`` input is produced by a :class:`StepInputSource` subclass registered for it with
:func:`register_source` (validate, build, before_advantage, after_update, state_dict / load_state_dict).
Extra rollouts go through the run's :class:`rlbench.rollout.groups.GroupSampler` with their own random
stream (rlbench.utils). A ``strategy`` input is read from the batch (``TrainBatch.extras``, padded from
``Completion.extras`` by collate); the validation refuses an advantage that reads one under a strategy
that does not list it in ``provides``. The inputs are tabled in docs/algorithms.md.

Configuration (under ``algorithm``):

    baseline:             # read only when the advantage takes baseline_rewards
      source: greedy      # greedy | reference (default: greedy for remax, reference for pvpo)
      samples: 8          # reference responses per prompt (reference only)
      refresh_every: null # re-estimate a prompt's reference mean after this many steps; null: never
      presample: false    # reference only: estimate every training problem before step 1 and drop those
                          # the reference solves in every sample (PVPO's pre-sampling)
    tracker:              # SPO's value tracker (spo only; see SPOTracker)
      rho_min: 0.875
      rho_max: 0.96
      d_half: 0.06
      rho: null           # a constant decay instead of the KL-adaptive one
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from rlbench.algorithm import Algorithm
from rlbench.algorithm.advantages import PVPOBaselineCache, SPOTracker
from rlbench.algorithm.registry import ADVANTAGES, POLICY_LOSSES
from rlbench.algorithm.step_inputs import STEP_INPUTS
from rlbench.config.schema import (
    AlgorithmConfig,
    BaselineConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    TrackerConfig,
)
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.reward.math import canonical_answer
from rlbench.rollout import GradedGroups, GroupSampler, validate_strategy
from rlbench.rollout.engines.base import Completion, RolloutEngine, SamplingParams
from rlbench.rollout.guided.mixed_traces import traces_when
from rlbench.rollout.strategy import STRATEGIES, strategy_class
from rlbench.training.batch import TrainBatch, collate
from rlbench.training.forward import batch_outputs
from rlbench.training.online_prm import OnlinePRM, paragraph_step_index
from rlbench.training.prompt_stats import PromptStatsStore, measure_before_training
from rlbench.utils import STREAM_GREEDY, STREAM_REFERENCE, make_generator

log = logging.getLogger(__name__)

RUNNER_PRODUCERS = ("source", "strategy")  # the STEP_INPUTS producers this module serves
BASELINE_SOURCES = ("greedy", "reference")
DEFAULT_BASELINE_SOURCE = {"remax": "greedy", "pvpo": "reference"}


# ------------------------------------------------------------------------------ pure functions


def answer_class_ids(extracted: Sequence[str | None]) -> torch.Tensor:
    """[B] long class ids: equal ids <=> equal ``canonical_answer`` of the extracted answers
    (``\\frac{1}{2}``, ``1/2`` and ``0.5`` share one). A response without an answer has nothing to
    match and gets its own negative id. Ids of answers count up from 0 in order of appearance."""
    classes: dict[str, int] = {}
    ids = []
    for row, answer in enumerate(extracted):
        key = canonical_answer(answer)
        ids.append(-(row + 1) if key is None else classes.setdefault(key, len(classes)))
    return torch.tensor(ids, dtype=torch.long)


def token_jaccard_distance(responses: Sequence[Sequence[int]]) -> torch.Tensor:
    """[B,B] pairwise dissimilarity d(i, j) = 1 - |S_i ∩ S_j| / |S_i ∪ S_j| of the sets S_i of token
    ids of the responses (0 on the diagonal; two empty responses are identical, d = 0). A cheap
    stand-in for the embedding-cluster diversity of polychromic objectives (Hamid et al. 2025,
    arXiv:2509.25424)."""
    vocabulary = sorted({t for response in responses for t in response})
    column = {t: j for j, t in enumerate(vocabulary)}
    incidence = torch.zeros(len(responses), len(vocabulary), dtype=torch.float64)
    for row, response in enumerate(responses):
        incidence[row, [column[t] for t in set(response)]] = 1.0
    shared = incidence @ incidence.T
    sizes = incidence.sum(dim=1)
    union = sizes[:, None] + sizes[None, :] - shared
    return torch.where(union > 0, 1.0 - shared / union.clamp(min=1), torch.zeros_like(union))


def mean_abs_logp_change(old_logp: torch.Tensor, new_logp: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B] D_i = sum_t m_it |logp_old,it - logp_new,it| / sum_t m_it: SPO's policy-change proxy on a
    prompt's previous response (Xu & Ding 2025, arXiv:2509.13232); 0 for an empty response."""
    mask = response_mask.to(torch.float64)
    change = ((old_logp.to(torch.float64) - new_logp.to(torch.float64)).abs() * mask).sum(dim=1)
    return change / mask.sum(dim=1).clamp(min=1)


def per_response(per_group: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """Gather one value per group to each of the group's responses ([G] -> [B])."""
    return per_group[group_index.long()]


def prompt_ids_of(graded: GradedGroups) -> list[tuple[int, ...]]:
    return [tuple(group[0].prompt_ids) for group in graded.groups]


# ------------------------------------------------------------------------------ options


@dataclass(frozen=True)
class BaselineOptions:
    """Where ``baseline_rewards`` come from (see the module docstring)."""

    source: str
    samples: int = 8
    refresh_every: int | None = None
    presample: bool = False

    @classmethod
    def from_config(cls, algorithm: AlgorithmConfig, advantage: str) -> BaselineOptions:
        """From ``algorithm.baseline`` (typed; its keys were checked by the schema walk)."""
        node = algorithm.baseline or BaselineConfig()
        source = node.source or DEFAULT_BASELINE_SOURCE.get(advantage)
        if source not in BASELINE_SOURCES:
            raise ConfigError(
                f"advantage '{advantage}' reads baseline_rewards; set algorithm.baseline.source to one of "
                f"{BASELINE_SOURCES} (got {source!r})"
            )
        options = cls(str(source), node.samples, node.refresh_every, node.presample)
        if options.samples < 1:
            raise ConfigError(f"algorithm.baseline.samples must be >= 1, got {options.samples}")
        if options.refresh_every is not None and int(options.refresh_every) < 1:
            raise ConfigError(f"algorithm.baseline.refresh_every must be >= 1 or null, got {options.refresh_every}")
        if options.presample and options.source != "reference":
            raise ConfigError(f"algorithm.baseline.presample=true pre-samples the reference policy; it needs "
                              f"algorithm.baseline.source=reference, not {options.source!r}")
        return options


def tracker_from_config(algorithm: AlgorithmConfig) -> SPOTracker:
    """An empty :class:`SPOTracker` with the decay settings of ``algorithm.tracker`` (typed)."""
    node = algorithm.tracker or TrackerConfig()
    tracker = SPOTracker(rho_min=node.rho_min, rho_max=node.rho_max, d_half=node.d_half, rho=node.rho)
    if not 0 < tracker.rho_min <= tracker.rho_max < 1:
        raise ConfigError(
            f"algorithm.tracker needs 0 < rho_min <= rho_max < 1, got rho_min={tracker.rho_min}, rho_max={tracker.rho_max}"
        )
    if tracker.d_half <= 0:
        raise ConfigError(f"algorithm.tracker.d_half must be > 0, got {tracker.d_half}")
    if tracker.rho is not None and not 0 < tracker.rho <= 1:
        raise ConfigError(f"algorithm.tracker.rho must be in (0, 1] or null, got {tracker.rho}")
    return tracker


def advantage_param(algorithm: Algorithm, name: str) -> Any:
    """The estimator's parameter ``name``: from the config, else the function's default."""
    if name in algorithm.advantage.params:
        return algorithm.advantage.params[name]
    return inspect.signature(ADVANTAGES.get(algorithm.advantage.name)).parameters[name].default


def runner_inputs() -> set[str]:
    """The advantage inputs this module provides: the STEP_INPUTS entries of :data:`RUNNER_PRODUCERS`."""
    return {e.name for e in STEP_INPUTS.read_by("advantage") if e.producer in RUNNER_PRODUCERS}


def needed_inputs(algorithm: Algorithm) -> set[str]:
    """The inputs of :func:`runner_inputs` the algorithm's estimator reads."""
    wanted = ADVANTAGES.accepted_inputs(algorithm.advantage.name) & runner_inputs()
    if {"answer_keys", "diversity"} <= wanted:  # polychromic reads one of the two
        wanted -= {"answer_keys", "diversity"}
        wanted.add(str(advantage_param(algorithm, "diversity_from")))
    return wanted


def reward_range(reward: RewardConfig) -> tuple[float, float] | None:
    """(lowest, highest) reward the configured grader gives; None when unknown."""
    if reward.name == "even_tokens":
        return 0.0, 1.0
    if reward.name == "fapo_genrm":
        return -1.0, 1.0
    if reward.name == "math":
        outcomes = [reward.incorrect_reward, reward.correct_reward]
        values = [o + bonus for o in outcomes for bonus in (0.0, reward.format_weight)]
        return min(values), max(values)
    return None


#: the strategy inputs algorithm.step_critic gives the responses of rollout=offline (rlbench/training/step_critic.py)
STEP_CRITIC_PROVIDES = frozenset({"step_index", "step_values"})


def check_strategy_inputs(rollout: RolloutConfig, advantage: str, needs: set[str], kind: str = "advantage",
                          step_critic: bool = False, paragraph_steps: bool = False) -> None:
    """ConfigError when advantage ``advantage`` (or the piece of another ``kind``) reads a strategy input
    (``needs``) that the configured rollout strategy (or ``step_critic``: algorithm.step_critic; ``paragraph_steps``:
    algorithm.online_prm.steps=paragraphs, which gives ``step_index``) does not provide, naming the strategies that
    provide every strategy input it reads."""
    provided = (strategy_class(rollout).provides | (STEP_CRITIC_PROVIDES if step_critic else frozenset())
                | (frozenset({"step_index"}) if paragraph_steps else frozenset()))
    wanted = {name for name in needs if name in STEP_INPUTS and STEP_INPUTS[name].producer == "strategy"}
    for name in sorted(wanted - provided):
        providers = sorted(key for key, cls in STRATEGIES.items() if wanted <= cls.provides)
        critic = " (or rollout=offline with algorithm.step_critic: a critic trained apart values them)" if (
            wanted <= STEP_CRITIC_PROVIDES) else ""
        raise ConfigError(
            f"{kind} '{advantage}' reads {name} ({STEP_INPUTS[name].doc}), which "
            f"rollout={rollout.strategy} does not provide; only the rollout strategies {providers} do{critic}. "
            f"Select rollout={' or rollout='.join(providers)}, or another {kind}"
        )


def validate_step_options(config: RunConfig, algorithm: Algorithm) -> None:
    """Refuse impossible combinations of the rollout-dependent options before anything is loaded."""
    rollout = config.rollout
    n = rollout.n
    name = algorithm.advantage.name
    prescribed = config.algorithm.rollout_n
    if prescribed is not None and prescribed != n:
        log.warning("algorithm '%s' prescribes rollout.n=%s; this run uses rollout.n=%d", algorithm.name, prescribed, n)
    validate_strategy(rollout, name)
    if name == "polychromic":
        diversity_from = advantage_param(algorithm, "diversity_from")
        if diversity_from not in ("answer_keys", "diversity"):
            raise ConfigError(
                f"algorithm.advantage.diversity_from must be 'answer_keys' or 'diversity', not {diversity_from!r}"
            )
    needs = needed_inputs(algorithm)
    critic = config.algorithm.step_critic is not None
    paragraphs = config.algorithm.online_prm is not None and config.algorithm.online_prm.steps == "paragraphs"
    check_strategy_inputs(rollout, name, needs, step_critic=critic, paragraph_steps=paragraphs)
    loss = algorithm.loss
    check_strategy_inputs(rollout, loss.name, POLICY_LOSSES.required_inputs(loss.name, loss.params), kind="loss",
                          step_critic=critic, paragraph_steps=paragraphs)
    if not isinstance(config.algorithm.overlong_filter, bool):
        raise ConfigError(f"algorithm.overlong_filter must be true or false, got {config.algorithm.overlong_filter!r}")
    for source in source_classes(needs):
        source.validate(config, algorithm)
    if rollout.strategy == "mixed_traces" and traces_when(rollout) == "reference_unsolved":
        presampled = "baseline_rewards" in needs and BaselineOptions.from_config(config.algorithm, name).presample
        if not presampled:
            raise ConfigError("rollout.mixed_traces.when=reference_unsolved gives traces to the prompts the reference never "
                              "solved before training, which only PVPO's pre-sampling measures: use it with algorithm=pvpo "
                              "(algorithm.baseline.presample=true)")
    if name == "polychromic":
        set_size = int(advantage_param(algorithm, "set_size"))
        if n <= set_size:
            raise ConfigError(
                f"advantage 'polychromic' scores sets of set_size={set_size} responses drawn from each group of "
                f"rollout.n={n}; with rollout.n <= set_size every group has one set and the polychromic advantage "
                f"is 0. Set rollout.n > {set_size} (the paper samples 8) or lower algorithm.advantage.set_size"
            )


# ------------------------------------------------------------------------------ sources


@dataclass(frozen=True)
class SourceContext:
    """What a source is built with: the run's sampler (its engine samples from ``model``), sampling
    parameters, the policy, the reference (None when the algorithm keeps none), the micro-batch size and
    the device."""

    sampler: GroupSampler
    params: SamplingParams
    model: torch.nn.Module
    reference: torch.nn.Module | None
    micro_batch_size: int
    device: torch.device


class StepInputSource:
    """The producer of ``source`` step inputs (rlbench/algorithm/step_inputs.py): each hook with its default.

    ``inputs``: the STEP_INPUTS names it produces (:func:`register_source` maps them to the class);
    ``checkpoint_key``: its key in the checkpoint's input state (None: it keeps no state)."""

    inputs: ClassVar[frozenset[str]] = frozenset()
    checkpoint_key: ClassVar[str | None] = None

    @classmethod
    def validate(cls, config: RunConfig, algorithm: Algorithm) -> None:
        """Refuse impossible options before the model loads (ConfigError)."""

    @classmethod
    def build(cls, config: RunConfig, algorithm: Algorithm, context: SourceContext) -> StepInputSource:
        return cls()

    def before_training(self, problems: list[Problem], stats: PromptStatsStore) -> list[Problem]:
        """Called once before the first step (and again on resume, after :meth:`load_state_dict`): the training
        problems the run draws from (PVPO's pre-sampling drops some); may record per-prompt facts in ``stats``."""
        return problems

    def before_advantage(self, graded: GradedGroups, batch: TrainBatch) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """(inputs by name, metrics) for this step's batch."""
        raise NotImplementedError

    def after_update(self, graded: GradedGroups) -> dict[str, float]:
        """State updates after the policy step; returns metrics."""
        return {}

    def state_dict(self) -> dict[str, Any] | None:
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s value."""


SOURCES: dict[str, type[StepInputSource]] = {}  # input name -> its source class


def register_source(cls: type[StepInputSource]) -> type[StepInputSource]:
    """Class decorator: ``cls`` produces its ``inputs``, each a ``source`` entry of STEP_INPUTS."""
    for name in cls.inputs:
        if name not in STEP_INPUTS or STEP_INPUTS[name].producer != "source":
            raise ValueError(f"{cls.__name__} produces {name!r}, which is not a 'source' entry of STEP_INPUTS")
        if name in SOURCES:
            raise ValueError(f"step input {name!r} has two sources: {SOURCES[name].__name__} and {cls.__name__}")
        SOURCES[name] = cls
    return cls


def source_classes(needs: set[str]) -> list[type[StepInputSource]]:
    """The source classes producing the ``source`` inputs among ``needs``, each once, in a fixed order."""
    wanted = [SOURCES[name] for name in sorted(needs) if STEP_INPUTS[name].producer == "source"]
    return list(dict.fromkeys(wanted))


class GreedyBaseline:
    """ReMax's baseline (Li et al. 2023, arXiv:2310.10505): b(x) = r(x, y_greedy), the reward (with the
    algorithm's reward shaping) of one greedy response of the current policy per prompt."""

    def __init__(self, sample: GroupSampler, params: SamplingParams, generator: torch.Generator):
        self.sample = sample
        self.params = SamplingParams(0.0, params.top_p, params.max_new_tokens)
        self.generator = generator

    def __call__(self, graded: GradedGroups) -> torch.Tensor:
        greedy = self.sample(graded.problems, 1, self.params, self.generator, prompt_ids_of(graded))
        return greedy.rewards

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])


class ReferenceAnchor:
    """PVPO's static anchor (Feng et al. 2025, arXiv:2508.21104): V_ref(x) = mean reward of
    ``samples`` responses of the reference policy (the frozen initial policy), sampled with the
    training rollout's parameters once per prompt uid and cached (:class:`PVPOBaselineCache`);
    re-estimated ``refresh_every`` steps after its last estimate when set (the paper's Figure 1: the
    reference updates R_ref at fixed steps). The engine samples from the reference while it generates
    them (``sync_weights``) and from the policy again afterwards.

    With ``presample`` (:meth:`presample`, PVPO's pre-sampling, the ACL version's abstract: "before
    training begins, PVPO performs a single round of rollouts" giving the static V and each sample's
    accuracy): every training problem is estimated before step 1, problems the reference solves in every
    sample are dropped from training, and each problem's reference pass rate goes to the statistics
    store, where ``rollout.mixed_traces.when=reference_unsolved`` reads it (ground-truth trajectories
    for the problems the reference never solves)."""

    def __init__(
        self,
        sample: GroupSampler,
        engine: RolloutEngine,
        policy: torch.nn.Module,
        reference: torch.nn.Module,
        options: BaselineOptions,
        params: SamplingParams,
        generator: torch.Generator,
    ):
        self.sample, self.engine, self.policy, self.reference = sample, engine, policy, reference
        self.options, self.params, self.generator = options, params, generator
        self.cache = PVPOBaselineCache(options.refresh_every)
        self.step = 0
        self.generated = 0
        self.accuracy: dict[Hashable, float] = {}  # uid -> the reference's pass rate at pre-sampling

    def reference_groups(self, problems: Sequence[Problem], prompt_ids: Sequence[tuple[int, ...]] | None) -> GradedGroups:
        """``samples`` graded responses of the reference policy per problem."""
        self.engine.sync_weights(self.reference)
        try:
            return self.sample(problems, self.options.samples, self.params, self.generator, prompt_ids)
        finally:
            self.engine.sync_weights(self.policy)

    def presample(self, problems: list[Problem], stats: PromptStatsStore) -> list[Problem]:
        """PVPO's pre-sampling: the reference's ``samples`` responses for every problem not estimated yet
        (on resume every one is: nothing is sampled), cached as its anchor at step 0; its pass rate is
        recorded in ``stats``; returns the problems whose pass rate is below 1 (ConfigError when none is)."""
        todo = [p for p in problems if p.uid not in self.accuracy]
        for uid, (rewards, pass_rate) in measure_before_training(todo, lambda chunk: self.reference_groups(chunk, None),
                                                                 "pvpo presample").items():
            self.cache.put(uid, rewards, 0)
            self.accuracy[uid] = pass_rate
        for uid, rate in self.accuracy.items():
            stats.set_reference(uid, rate)
        kept = [p for p in problems if self.accuracy[p.uid] < 1]
        unsolved = sum(1 for p in kept if self.accuracy[p.uid] == 0)
        log.info("PVPO pre-sampling: %d of %d training problems kept (%d solved in all %d reference samples dropped); "
                 "%d never solved", len(kept), len(problems), len(problems) - len(kept), self.options.samples, unsolved)
        if not kept:
            raise ConfigError(f"PVPO pre-sampling: the reference solves every one of the {len(problems)} training problems in "
                              f"all {self.options.samples} samples, so none is left to train on; use harder problems, or "
                              "algorithm.baseline.presample=false")
        return kept

    def __call__(self, graded: GradedGroups) -> torch.Tensor:
        due: dict[Hashable, int] = {}
        for g, problem in enumerate(graded.problems):
            if problem.uid not in due and self.cache.stale(problem.uid, self.step):
                due[problem.uid] = g
        if due:
            groups = list(due.values())
            prompt_ids = prompt_ids_of(graded)
            reference = self.reference_groups([graded.problems[g] for g in groups], [prompt_ids[g] for g in groups])
            for k, uid in enumerate(due):
                self.cache.put(uid, reference.rewards[reference.group_index == k].tolist(), self.step)
            self.generated = len(reference.rewards)
        else:
            self.generated = 0
        self.step += 1
        return self.cache.baseline([p.uid for p in graded.problems])

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state(), "cache": self.cache.state_dict(), "step": self.step,
                "accuracy": dict(self.accuracy)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
        self.cache.load_state_dict(state["cache"])
        self.step = int(state["step"])
        self.accuracy = {uid: float(rate) for uid, rate in state["accuracy"].items()}


@register_source
class SPOStream(StepInputSource):
    """SPO's per-prompt value tracker across steps (Xu & Ding 2025, "Single-stream Policy
    Optimization", arXiv:2509.13232), keyed by problem uid.

    Before the advantage: ``tracker_baseline`` = p_hat(x) of each response's prompt (pre-update).
    After the policy step, for each response i of prompt x (in batch order):
        D   = mean_t |logp_then - logp_now| on the response stored at x's previous visit (0 on the first)
        rho = clip(2^(-D / d_half), rho_min, rho_max)  (or the constant rho)
        (alpha, beta) <- (rho alpha + r_i, rho beta + 1 - r_i)
    and the response with its pre-update log-probs becomes x's stored response. The adaptive decay
    costs a no-grad pass over this step's responses (unless the batch holds old log-probs) and one
    over the stored responses of revisited prompts.
    """

    inputs = frozenset({"tracker_baseline"})
    checkpoint_key = "spo"

    def __init__(self, tracker: SPOTracker, model: torch.nn.Module, pad_token_id: int, micro_batch_size: int,
                 temperature: float, device: torch.device):
        self.tracker, self.model = tracker, model
        self.pad_token_id, self.micro_batch_size, self.temperature, self.device = (
            pad_token_id, micro_batch_size, temperature, device,
        )
        self.previous: dict[Hashable, Completion] = {}  # uid -> response; logprobs = pre-update log-probs
        self.pending_logp: torch.Tensor | None = None
        self.last_change: torch.Tensor | None = None  # D of the last update's responses

    @classmethod
    def validate(cls, config: RunConfig, algorithm: Algorithm) -> None:
        """The tracker's settings, and rewards that stay in [0, 1] (a Beta posterior over successes)."""
        tracker_from_config(config.algorithm)
        low_high = reward_range(config.reward)
        if algorithm.reward_shaping or low_high is None or not (0.0 <= low_high[0] and low_high[1] <= 1.0):
            raise ConfigError(
                f"advantage 'spo' tracks a success probability (a Beta posterior over rewards in [0, 1]); reward "
                f"'{config.reward.name}' with range {low_high} and reward shaping "
                f"{[s.name for s in algorithm.reward_shaping]} can leave [0, 1]. Use rewards in [0, 1] "
                "(reward.correct_reward=1 reward.incorrect_reward=0 reward.format_weight=0) and no reward_shaping"
            )

    @classmethod
    def build(cls, config: RunConfig, algorithm: Algorithm, context: SourceContext) -> SPOStream:
        temperature = context.params.temperature if context.params.temperature > 0 else 1.0
        return cls(tracker_from_config(config.algorithm), context.model, context.sampler.tokenizer.pad_token_id,
                   context.micro_batch_size, temperature, context.device)

    @property
    def adaptive(self) -> bool:
        return self.tracker.rho is None

    def before_advantage(self, graded: GradedGroups, batch: TrainBatch) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        baseline = self.baseline(graded, batch).to(batch.response_mask.device)
        return {"tracker_baseline": baseline}, {"tracker_baseline_mean": float(baseline.mean().item())}

    def after_update(self, graded: GradedGroups) -> dict[str, float]:
        self.update(graded)
        if self.last_change is None:
            return {}
        return {"tracker_policy_change_mean": float(self.last_change.mean().item())}

    def baseline(self, graded: GradedGroups, batch: TrainBatch) -> torch.Tensor:
        if self.adaptive:
            self.pending_logp = batch.old_logp if batch.old_logp is not None else self._logprobs(batch)
        return self.tracker.baseline(graded.uids)

    def _logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return batch_outputs(self.model, batch, self.micro_batch_size, self.temperature).logp

    def policy_change(self, uids: Sequence[Hashable]) -> torch.Tensor:
        """[B] D of each uid's stored response under the current policy (0 for unseen uids)."""
        change = torch.zeros(len(uids), dtype=torch.float64)
        seen = [row for row, uid in enumerate(uids) if uid in self.previous]
        if not seen:
            return change
        stored = [self.previous[uids[row]] for row in seen]
        batch = collate([[c] for c in stored], self.pad_token_id, self.device)
        now = self._logprobs(batch)
        then = torch.zeros_like(now)
        for row, c in enumerate(stored):
            then[row, : len(c.logprobs)] = torch.tensor(c.logprobs, dtype=then.dtype)
        change[seen] = mean_abs_logp_change(then, now, batch.response_mask).cpu()
        return change

    def update(self, graded: GradedGroups) -> None:
        uids = graded.uids
        kls = self.policy_change(uids) if self.adaptive else torch.zeros(len(uids), dtype=torch.float64)
        self.tracker.update(uids, graded.rewards.tolist(), kls.tolist())
        if self.adaptive:
            self.last_change = kls
            lengths = [len(c.response_ids) for group in graded.groups for c in group]
            responses = [c for group in graded.groups for c in group]
            for row, (uid, response) in enumerate(zip(uids, responses)):
                logprobs = self.pending_logp[row, : lengths[row]].tolist()
                self.previous[uid] = Completion(0, tuple(response.prompt_ids), list(response.response_ids), logprobs, True)
        self.pending_logp = None

    def state_dict(self) -> dict[str, Any]:
        """The tracker and each prompt's stored response (between steps nothing is pending)."""
        previous = {uid: {"prompt_ids": list(c.prompt_ids), "response_ids": list(c.response_ids), "logprobs": list(c.logprobs)}
                    for uid, c in self.previous.items()}
        return {"tracker": self.tracker.state_dict(), "previous": previous}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tracker.load_state_dict(state["tracker"])
        self.previous = {uid: Completion(0, tuple(c["prompt_ids"]), list(c["response_ids"]), list(c["logprobs"]), True)
                         for uid, c in state["previous"].items()}


@register_source
class BaselineRewards(StepInputSource):
    """``baseline_rewards``: each response's prompt's baseline reward, from ``algorithm.baseline.source``:
    :class:`GreedyBaseline` (remax) or :class:`ReferenceAnchor` (pvpo)."""

    inputs = frozenset({"baseline_rewards"})
    checkpoint_key = "baseline"

    def __init__(self, baseline: GreedyBaseline | ReferenceAnchor):
        self.baseline = baseline

    @classmethod
    def validate(cls, config: RunConfig, algorithm: Algorithm) -> None:
        options = BaselineOptions.from_config(config.algorithm, algorithm.advantage.name)
        if options.presample and config.trainer.parallelism != "single":
            raise ConfigError(f"algorithm.baseline.presample=true is not supported with trainer.parallelism="
                              f"{config.trainer.parallelism} (each process would filter the problems by its own samples)")

    def before_training(self, problems: list[Problem], stats: PromptStatsStore) -> list[Problem]:
        if isinstance(self.baseline, ReferenceAnchor) and self.baseline.options.presample:
            return self.baseline.presample(problems, stats)
        return problems

    @classmethod
    def build(cls, config: RunConfig, algorithm: Algorithm, context: SourceContext) -> BaselineRewards:
        """The greedy baseline, or PVPO's anchor sampling from ``context.reference`` (a frozen copy of the
        initial policy when the algorithm keeps no reference)."""
        options = BaselineOptions.from_config(config.algorithm, algorithm.advantage.name)
        sampler, params, model = context.sampler, context.params, context.model
        if options.source == "greedy":
            return cls(GreedyBaseline(sampler, params, make_generator(config.seed, STREAM_GREEDY)))
        frozen = context.reference if context.reference is not None else copy.deepcopy(model).eval().requires_grad_(False)
        return cls(ReferenceAnchor(sampler, sampler.engine, model, frozen, options, params,
                                   make_generator(config.seed, STREAM_REFERENCE)))

    def before_advantage(self, graded: GradedGroups, batch: TrainBatch) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        per_group = self.baseline(graded)
        metrics = {"baseline_reward_mean": float(per_group.mean().item())}
        if isinstance(self.baseline, ReferenceAnchor):
            metrics["reference_responses"] = float(self.baseline.generated)
        return {"baseline_rewards": per_response(per_group, graded.group_index).to(batch.response_mask.device)}, metrics

    def state_dict(self) -> dict[str, Any]:
        return self.baseline.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.baseline.load_state_dict(state)


@register_source
class AnswerKeys(StepInputSource):
    """``answer_keys``: class ids of the grader's extracted answers (:func:`answer_class_ids`; polychromic)."""

    inputs = frozenset({"answer_keys"})

    def before_advantage(self, graded: GradedGroups, batch: TrainBatch) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        keys = answer_class_ids([grade.extracted for grade in graded.grades])
        return {"answer_keys": keys.to(batch.response_mask.device)}, {}


@register_source
class ResponseDiversity(StepInputSource):
    """``diversity``: the responses' pairwise token-set Jaccard distances (:func:`token_jaccard_distance`;
    polychromic with diversity_from=diversity)."""

    inputs = frozenset({"diversity"})

    def before_advantage(self, graded: GradedGroups, batch: TrainBatch) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        responses = [c.response_ids for group in graded.groups for c in group]
        return {"diversity": token_jaccard_distance(responses).to(batch.response_mask.device)}, {}


@register_source
class ImplicitProcessRewards(StepInputSource):
    """``step_process_rewards``: OPRL's implicit PRM (:class:`rlbench.training.online_prm.OnlinePRM`), trained on the
    step's outcome-ranked pairs and then scoring every step, before the advantage; its weights and optimizer state are
    checkpointed. Needs the step structure (``step_index``: rollout=multi_turn's turns, or, with ``steps: paragraphs``,
    the paragraphs of single-turn responses, which it gives the batch itself), full fine-tuning and one process."""

    inputs = frozenset({"step_process_rewards"})
    checkpoint_key = "online_prm"

    def __init__(self, prm: OnlinePRM, tokenizer: Any = None):
        self.prm = prm
        self.tokenizer = tokenizer  # steps: paragraphs: the tokens' text, to cut the responses at blank lines

    @classmethod
    def validate(cls, config: RunConfig, algorithm: Algorithm) -> None:
        if config.algorithm.online_prm is None:
            raise ConfigError("the step rewards of OPRL's implicit PRM need algorithm.online_prm={beta, lr, updates}")
        if config.algorithm.online_prm.baseline not in ("reference", "policy"):
            raise ConfigError("algorithm.online_prm.baseline must be reference (the frozen initial policy) or policy (the "
                              f"policy that sampled the step, the paper's pi_theta_old), got {config.algorithm.online_prm.baseline!r}")
        steps = config.algorithm.online_prm.steps
        if steps not in ("turns", "paragraphs"):
            raise ConfigError(f"algorithm.online_prm.steps must be turns (rollout=multi_turn's) or paragraphs (single-turn "
                              f"responses cut at blank lines), got {steps!r}")
        if steps == "paragraphs" and "step_index" in strategy_class(config.rollout).provides:
            raise ConfigError(f"algorithm.online_prm.steps=paragraphs cuts single-turn responses at blank lines, but "
                              f"rollout={config.rollout.strategy} gives its own steps (step_index): use steps=turns")
        if config.model.lora is not None or config.trainer.parallelism != "single":
            raise ConfigError("algorithm.online_prm (OPRL's implicit PRM) trains a full copy of the initial policy in one "
                              "process: model.lora (the reference is the policy with adapters off) and "
                              f"trainer.parallelism={config.trainer.parallelism} (the PRM is neither sharded nor "
                              "replicated per rank) are refused")

    @classmethod
    def build(cls, config: RunConfig, algorithm: Algorithm, context: SourceContext) -> StepInputSource:
        settings = config.algorithm.online_prm
        if settings.baseline == "reference" and context.reference is None:
            raise ConfigError("algorithm.online_prm.baseline=reference reads the frozen reference model, which this run does not load")
        temperature = context.params.temperature if context.params.temperature > 0 else 1.0
        initial = context.reference if settings.baseline == "reference" else context.model  # before its first step
        return cls(OnlinePRM.from_reference(settings, initial, context.micro_batch_size, temperature,
                                            policy=context.model if settings.baseline == "policy" else None),
                   tokenizer=context.sampler.tokenizer if settings.steps == "paragraphs" else None)

    def before_advantage(self, graded: GradedGroups, batch: TrainBatch) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        if self.tokenizer is not None:  # steps: paragraphs (the advantage reads the same step_index from the batch)
            responses = [c.response_ids for group in graded.groups for c in group]
            batch.extras["step_index"] = paragraph_step_index(responses, self.tokenizer, batch.response_mask)
        scored = self.prm.scored(batch)  # log pi_base, before the PRM's update and the policy's
        metrics = self.prm.update(scored)
        rewards, measured = self.prm.step_rewards(scored)
        return {"step_process_rewards": rewards.to(batch.response_mask.device)}, {**metrics, **measured}

    def state_dict(self) -> dict[str, Any]:
        return self.prm.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prm.load_state_dict(state)


class AdvantageInputSources:
    """The advantage inputs of :func:`runner_inputs` one run's estimator reads (``needs``): the sources
    that produce them, and the strategy inputs the batch carries."""

    def __init__(self, needs: set[str], sources: Sequence[StepInputSource] = ()):
        self.needs, self.sources = needs, list(sources)

    @classmethod
    def from_config(
        cls,
        config: RunConfig,
        algorithm: Algorithm,
        sampler: GroupSampler,
        params: SamplingParams,
        model: torch.nn.Module,
        reference: torch.nn.Module | None,
        micro_batch_size: int,
        device: torch.device,
    ) -> AdvantageInputSources:
        """The sources the estimator of ``algorithm`` needs (:class:`SourceContext` for the arguments)."""
        needs = needed_inputs(algorithm)
        context = SourceContext(sampler, params, model, reference, micro_batch_size, device)
        return cls(needs, [source.build(config, algorithm, context) for source in source_classes(needs)])

    def before_training(self, problems: list[Problem], stats: PromptStatsStore) -> list[Problem]:
        """The training problems after every source's :meth:`StepInputSource.before_training`, in turn."""
        for source in self.sources:
            problems = source.before_training(problems, stats)
        return problems

    def before_advantage(self, graded: GradedGroups, batch: TrainBatch) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """(inputs for the estimator, metrics) of this step's batch."""
        inputs: dict[str, torch.Tensor] = {}
        metrics: dict[str, float] = {}
        for source in self.sources:
            produced, measured = source.before_advantage(graded, batch)
            inputs.update(produced)
            metrics.update(measured)
        for name in sorted(self.needs & STEP_INPUTS.names(producer="strategy")):
            if name not in batch.extras:
                raise ValueError(f"no response carries {name}, which the advantage reads (Completion.extras of the strategy)")
            inputs[name] = batch.extras[name]
        return inputs, metrics

    def state_dict(self) -> dict[str, Any]:
        """The sources' state across steps (random streams, caches, trackers) for checkpoints, by checkpoint key."""
        return {source.checkpoint_key: source.state_dict() for source in self.sources if source.checkpoint_key}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for source in self.sources:
            if source.checkpoint_key:
                source.load_state_dict(state[source.checkpoint_key])

    def after_update(self, graded: GradedGroups) -> dict[str, float]:
        """State updates after the policy step (SPO's tracker); returns metrics."""
        metrics: dict[str, float] = {}
        for source in self.sources:
            metrics.update(source.after_update(graded))
        return metrics
