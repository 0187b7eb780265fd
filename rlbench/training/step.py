"""One training step, as in the papers' pseudo-code:

    groups   <- rollout strategy(prompts)                  n graded responses per prompt (rlbench.rollout)
    rewards  <- grader(responses) + reward shaping         (inside the strategy: GroupSampler)
    inputs   <- log-probs / entropies / values of the sampling policy, reference log-probs, and the
                inputs that need more than the batch (baselines, SPO tracker, answer keys)
    A        <- advantage estimator(rewards, groups, inputs)
    theta    <- update schedule on the algorithm's loss    (standard | sfpo | trpo; ewma proximal policy)
    metrics

:func:`train_step` is that list; each line is one function below. :class:`StepContext` holds what
the steps of one run share and is built once, complete, by :func:`make_step_context`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rlbench import faults
from rlbench.algorithm import Algorithm
from rlbench.algorithm.critic import value_targets
from rlbench.algorithm.kl import difficulty_kl_scale
from rlbench.config.schema import DatasetConfig, RunConfig
from rlbench.dataset.base import Problem
from rlbench.model.lora import AdaptersOff, reference_model
from rlbench.rollout import (
    GradedGroups,
    GroupSampler,
    RolloutSetup,
    RolloutStrategy,
    make_strategy,
)
from rlbench.rollout.engines import frozen_model_engine
from rlbench.rollout.engines.base import RolloutEngine, SamplingParams
from rlbench.rollout.env import env_factory
from rlbench.rollout.judge_backend import make_reward_composer
from rlbench.training.advantage_inputs import AdvantageInputSources
from rlbench.training.batch import (
    TrainBatch,
    collate,
    kept_responses,
    mask_truncated,
    trainable_tokens,
)
from rlbench.training.distributed import (
    SINGLE,
    World,
    rank_stream_seed,
    unwrap,
    wrap_model,
)
from rlbench.training.forward import batch_outputs, training_logits_transform
from rlbench.training.memory import PeakMemory, keep_freed_memory
from rlbench.training.prompt_stats import PromptStatsStore
from rlbench.training.reference_cache import (
    ReferenceLogProbCache,
    offline_reference_cache,
    reference_log_probs,
)
from rlbench.training.reference_rewards import ReferenceRewards
from rlbench.training.preference_model import PreferenceModel
from rlbench.training.step_critic import StepCritic
from rlbench.errors import ConfigError
from rlbench.training.reference_soup import ReferenceSoup, frozen_checkpoint
from rlbench.training.rewrites import response_labels
from rlbench.training.rounds import RoundPolicy
from rlbench.training.update import LossStreams
from rlbench.training.update_schedules import (
    UpdateState,
    apply_update_schedule,
    make_update_state,
)
from rlbench.utils import STREAM_MINIBATCH, STREAM_ROLLOUT, make_generator

# Step metrics measured in wall-clock seconds (or derived from them) and the process's peak memory:
# they differ between two runs of one seed; every other metric is repeatable bit for bit on one machine.
TIMING_METRICS = frozenset({"generate_s", "update_s", "step_s", "tokens_per_s", "engine_s", "queue_wait_s", "peak_memory_mb", "judge_s"})


@dataclass
class StepContext:
    """Everything one training step needs (built once per run by :func:`make_step_context`)."""

    algorithm: Algorithm
    model: torch.nn.Module
    tokenizer: Any
    engine: RolloutEngine
    strategy: RolloutStrategy  # prompts -> graded groups (iid, dynamic_sampling, ...)
    sampler: GroupSampler  # every engine call of training goes through it (it counts the generation cost)
    inputs: AdvantageInputSources  # remax/pvpo baselines, SPO tracker, answer keys
    update_state: UpdateState  # value head, EWMA proximal policy, SFPO switch
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    params: SamplingParams
    micro_batch_size: int
    max_grad_norm: float | None
    device: torch.device
    minibatch_generator: torch.Generator
    reference: torch.nn.Module | None = None
    overlong_filter: bool = False
    world: World = SINGLE  # trainer.parallelism=ddp|fsdp: this rank's place (rlbench.training.distributed)
    policy_version: int = 0  # policy updates so far; stamps the responses sampled at this step
    rollout_generator: torch.Generator | None = None  # the strategy's random stream (RolloutSetup.generator)
    reincarnate_at: int | None = None  # algorithm.reincarnate_at: ReMix's policy reincarnation (:func:`reincarnate`)
    reference_soup: ReferenceSoup | None = None  # algorithm.reference_soup: the reference as a weight soup (SALSA)
    prompt_stats: PromptStatsStore | None = None  # the run's per-prompt statistics (the curriculum's, read by strategies)
    reference_cache: ReferenceLogProbCache | None = None  # rollout=offline: log pi_ref per response, computed once
    rounds: RoundPolicy | None = None  # algorithm.update.round_steps: the loss's frozen pi_t (INPO's, REBEL's rounds)
    dpo_policy: torch.nn.Module | None = None  # algorithm.rto: the frozen DPO model pi_dpo of RTO's token reward
    reference_rewards: ReferenceRewards | None = None  # algorithm.qrpo.reference_samples: QRPO's K pi_ref samples per prompt
    step_critic: StepCritic | None = None  # algorithm.step_critic: Direct Advantage PO's critic, fitted before the actor
    preference_model: PreferenceModel | None = None  # algorithm.preference_model: DRPO's, fitted before the actor
    seed: int = 0  # the run's seed: the policy loss's random streams derive from it (LossStreams)

    @property
    def reincarnated(self) -> bool:
        """True once step ``reincarnate_at`` has started (policy_version counts the steps trained before)."""
        return self.reincarnate_at is not None and self.policy_version + 1 > self.reincarnate_at

    @property
    def temperature(self) -> float:
        """The temperature the log-probs are computed at: the sampling one (1 for greedy sampling)."""
        return self.params.temperature if self.params.temperature > 0 else 1.0

    def state_dict(self) -> dict[str, Any]:
        """What the steps carry from one to the next, besides the model's weights and the optimizer
        (rlbench.training.checkpoint saves those): the lr schedule, the random streams, the adaptive
        coefficients, the policy version and the state of the strategy, the advantage inputs and the
        update (each part's own ``state_dict``)."""
        return {
            "policy_version": self.policy_version,
            "coefficients": dataclasses.asdict(self.algorithm.coefficients),
            "scheduler": self.scheduler.state_dict(),
            "rollout_generator": None if self.rollout_generator is None else self.rollout_generator.get_state(),
            "minibatch_generator": self.minibatch_generator.get_state(),
            "strategy": self.strategy.state_dict(),
            "inputs": self.inputs.state_dict(),
            "update_state": self.update_state.state_dict(),
            # after a reincarnation the reference is no longer the initial policy: it is saved
            "reference": self.reference.state_dict() if self.reincarnated and self.reference is not None else None,
            "reference_soup": None if self.reference_soup is None else self.reference_soup.state_dict(),
            "rounds": None if self.rounds is None else self.rounds.state_dict(self.policy_version),
            "reward_terms": self.sampler.compose.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.policy_version = int(state["policy_version"])
        for key, value in state["coefficients"].items():
            setattr(self.algorithm.coefficients, key, value)
        self.scheduler.load_state_dict(state["scheduler"])
        if self.rollout_generator is not None:
            self.rollout_generator.set_state(state["rollout_generator"])
        self.minibatch_generator.set_state(state["minibatch_generator"])
        if state["strategy"] is not None:
            self.strategy.load_state_dict(state["strategy"])
        self.inputs.load_state_dict(state["inputs"])
        self.update_state.load_state_dict(state["update_state"])
        if state.get("reference") is not None:
            self.reference.load_state_dict(state["reference"])
        if self.reference_soup is not None:
            self.reference_soup.load_state_dict(state["reference_soup"])
        if self.rounds is not None:
            self.rounds.load_state_dict(state.get("rounds"), self.policy_version)
        if "reward_terms" in state:  # checkpoints before composed rewards have none
            self.sampler.compose.load_state_dict(state["reward_terms"])


def make_step_context(
    config: RunConfig, algorithm: Algorithm, model: torch.nn.Module, tokenizer: Any, engine: RolloutEngine,
    device: torch.device, grader: Any, guidance: Any = None, world: World = SINGLE,
) -> StepContext:
    """``config``: the run's typed config (rlbench.config.typed); ``grader``: the training set's
    (rlbench.reward.graders.training_grader). ``guidance``: the run's checked traces
    (rlbench.guidance.load_guidance), for the strategies that mix them into groups or take hints from
    them. ``model`` is the plain (or LoRA) policy the engine samples from; under ddp / fsdp it is
    wrapped here (the reference is taken before), and the update runs the wrapped module."""
    trainer, rollout = config.trainer, config.rollout
    if torch.device(device).type == "cpu" and trainer.reuse_freed_memory:
        keep_freed_memory()  # process-wide: large CPU tensors reuse freed pages (rlbench/training/memory.py)
    update_state = make_update_state(algorithm, model, trainer)
    reference = reference_model(model) if algorithm.needs_reference else None
    dpo_policy = None if algorithm.rto is None else frozen_checkpoint(model, algorithm.rto.dpo_model, "algorithm.rto.dpo_model")
    if reference is not None and world.sharded and not isinstance(reference, AdaptersOff):
        reference = wrap_model(reference, world)
    trained = wrap_model(model, world)
    if world.sharded:  # every forward is collective under FSDP: generate until every rank is done
        engine.synced_gpus = True
    # The fused AdamW kernel (one pass over all parameters) is ~4x faster on CPU than the default.
    # Frozen parameters (the base weights under LoRA) are left out.
    optimizer = torch.optim.AdamW(
        [p for p in update_state.parameters(trained) if p.requires_grad], lr=trainer.lr, betas=tuple(trainer.betas),
        weight_decay=trainer.weight_decay, fused=True,
    )
    warmup = max(trainer.warmup_steps, 0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (warmup + 1)))
    params = SamplingParams(rollout.temperature, rollout.top_p, rollout.max_new_tokens)
    sampler = GroupSampler(engine, grader, tokenizer, prompt_spec(config.dataset), algorithm.shape_rewards,
                           compose=make_reward_composer(config, engine, model, tokenizer, device),
                           prompt_instruction=algorithm.prompt_instruction)
    # rank 0 samples what one process samples; other ranks draw their own stream (docs/scaling.md)
    rollout_generator = torch.Generator().manual_seed(
        rank_stream_seed(make_generator(config.seed, STREAM_ROLLOUT).initial_seed(), world.rank)
    )
    prompt_stats = PromptStatsStore()  # fed by the curriculum (rlbench.training.loop), read by samplers and strategies
    setup = RolloutSetup(sampler, rollout.n, params, rollout_generator, config.seed, guidance, prompt_stats,
                         env_factory(config.env, grader, config.sandbox))
    ctx = StepContext(
        algorithm=algorithm,
        model=trained,
        tokenizer=tokenizer,
        engine=engine,
        strategy=make_strategy(rollout, setup),
        sampler=sampler,
        inputs=AdvantageInputSources.from_config(
            config, algorithm, sampler, params, model, reference, trainer.micro_batch_size, device
        ),
        update_state=update_state,
        optimizer=optimizer,
        scheduler=scheduler,
        params=params,
        micro_batch_size=trainer.micro_batch_size,
        max_grad_norm=trainer.max_grad_norm,
        device=device,
        minibatch_generator=make_generator(config.seed, STREAM_MINIBATCH),
        reference=reference,
        overlong_filter=config.algorithm.overlong_filter,
        rollout_generator=rollout_generator,
        world=world,
        reincarnate_at=config.algorithm.reincarnate_at,
        reference_soup=ReferenceSoup.from_config(config.algorithm.reference_soup, reference),
        prompt_stats=prompt_stats,
        rounds=RoundPolicy.from_algorithm(algorithm.round_steps, model, round_engine(config, algorithm, tokenizer, device)),
        dpo_policy=dpo_policy,
        seed=config.seed,
    )
    ctx.reference_cache = offline_reference_cache(config, reference, guidance, ctx.temperature, world.sharded)
    if algorithm.reference_samples:
        ctx.reference_rewards = ReferenceRewards.from_config(config, reference, sampler, params, algorithm.reward_shaping, device)
    if config.algorithm.step_critic is not None:
        if reference is None:
            raise ConfigError("algorithm.step_critic starts from the frozen reference model, which this run does not load")
        ctx.step_critic = StepCritic.from_config(config, reference, sampler, params, algorithm.reward_shaping, device)
    if config.algorithm.preference_model is not None:
        if reference is None:
            raise ConfigError("algorithm.preference_model starts from the frozen reference model, which this run does not load")
        ctx.preference_model = PreferenceModel.from_config(config, reference, sampler, params, algorithm.reward_shaping)
    return ctx


def round_engine(config: RunConfig, algorithm: Algorithm, tokenizer: Any, device: torch.device) -> Callable | None:
    """How the rounds' frozen pi_t gets its own engine (algorithm.update.round_sampling=pi_t; frozen_model_engine)."""
    if algorithm.round_steps is None or algorithm.round_sampling != "pi_t":
        return None
    return lambda snapshot: frozen_model_engine(config.rollout, snapshot, tokenizer, device)


def prompt_spec(dataset: DatasetConfig) -> dict[str, Any] | None:
    """The dataset's prompt templates as the mapping rlbench.dataset.prompts reads (None: the defaults)."""
    return None if dataset.prompt is None else dataclasses.asdict(dataset.prompt)


def train_step(
    ctx: StepContext,
    problems: list[Problem],
    progress: float = 0.0,
    draw_prompts: Callable[[int], list[Problem]] | None = None,
    observe: Callable[[GradedGroups], None] | None = None,
) -> dict[str, float]:
    """rollout -> reward -> advantage inputs -> advantages -> update -> metrics for one batch of
    prompts. Returns the step's metrics.

    ``progress`` is the fraction of training done before this step (for annealed losses);
    ``draw_prompts(k)`` gives k more prompts (for strategies that draw them: dynamic sampling);
    ``observe(groups)`` sees the graded groups (the curricula's per-prompt statistics) and may return the groups the
    step trains on instead (CLPO's same-step rewrites, rlbench.training.rewrites; None: the step's own)."""
    t0 = time.perf_counter()
    peak = PeakMemory(ctx.device)
    problems = ctx.world.shard(problems)  # whole groups per rank (all of them in one process)
    if ctx.reincarnate_at is not None and ctx.policy_version + 1 == ctx.reincarnate_at:
        reincarnate(ctx)
        if ctx.algorithm.loss_has_stages:  # SACPO: stage 2 is a fine-tuning run of its own (arXiv:2404.11049)
            ctx.optimizer.state.clear()  # Adam's moments start again; stage 1's would push on along its objective
    if ctx.rounds is None:
        graded, rollout_metrics = ctx.strategy.rollout(problems, draw_prompts)  # rollout and reward
    else:  # iterative rounds: pi_t is taken before the round's first rollout, and samples the round (round_sampling)
        ctx.rounds.begin_step(ctx.model, ctx.policy_version)
        with ctx.rounds.sampling(ctx.sampler):
            graded, rollout_metrics = ctx.strategy.rollout(problems, draw_prompts)
    t_generate = time.perf_counter() - t0
    faults.kill_point("generate")
    stamp_policy_version(graded, ctx.policy_version)
    trained = observe(graded) if observe is not None else None
    if trained is not None:
        graded = trained
        stamp_policy_version(graded, ctx.policy_version)  # a curriculum's extra groups were sampled now
    return learn_step(ctx, graded, rollout_metrics, progress, t_generate, started=t0, peak=peak)


def learn_step(
    ctx: StepContext,
    graded: GradedGroups,
    rollout_metrics: dict[str, float],
    progress: float,
    t_generate: float,
    started: float,
    generation_cost: dict[str, float] | None = None,
    peak: PeakMemory | None = None,
) -> dict[str, float]:
    """Everything after the rollout: advantage inputs -> advantages -> update -> metrics, on groups
    whose responses are stamped with the policy version that sampled them (the synchronous step's
    own, or an older one when an asynchronous generator produced them: rlbench/training/async_pipeline.py).
    ``started``: when the step's clock started; ``generation_cost``: the generator's counts
    (GenerationCost.take) when they were taken elsewhere, else the sampler's are taken here;
    ``peak``: the step's peak-memory meter when it started with the rollout (else it starts here)."""
    peak = peak if peak is not None else PeakMemory(ctx.device)
    critic_metrics = {}
    if ctx.step_critic is not None:  # Direct Advantage PO: the critic, fitted once before the actor, values the steps
        ctx.step_critic.prepare(ctx.strategy.dataset)
        critic_metrics = ctx.step_critic.annotate(graded)
    if ctx.preference_model is not None:  # DRPO: the preference model, fitted once before the actor
        ctx.preference_model.prepare(ctx.strategy.dataset)
    batch = to_batch(ctx, graded)
    t1 = time.perf_counter()
    round_metrics = {} if ctx.rounds is None else ctx.rounds.begin_step(ctx.model, ctx.policy_version)
    # a strategy that samples from a changed distribution (rollout=masked) changes the step's forwards alike
    with training_logits_transform(ctx.strategy.training_logits_transform()):
        inputs, input_metrics = advantage_inputs(ctx, graded, batch)
        response_kl = compute_advantages(ctx, batch, inputs, progress)
        coefficients = {"kl_coef": ctx.algorithm.kl_coefficient, "entropy_coef": ctx.algorithm.entropy_coefficient}
        stats = update(ctx, batch, graded.finished.to(ctx.device), progress, response_kl)
    input_metrics.update(ctx.inputs.after_update(graded))
    ctx.policy_version += 1
    if ctx.reference_soup is not None:
        input_metrics.update(ctx.reference_soup.after_update(ctx.model, ctx.policy_version))
    t_update = time.perf_counter() - t1
    step_time = time.perf_counter() - started
    lengths = batch.response_mask.sum(-1)
    return ctx.world.mean_metrics({
        **step_metrics(graded, batch, response_kl),
        **coefficients,
        "lr": ctx.scheduler.get_last_lr()[0],
        "generate_s": t_generate,
        "update_s": t_update,
        "step_s": step_time,
        "tokens_per_s": float(lengths.sum().item()) / step_time,
        "trained_tokens": float(batch.response_mask.sum().item()),
        **(ctx.sampler.cost.take() if generation_cost is None else generation_cost),
        **rollout_metrics,
        **behaviour_metrics(graded, batch),
        **input_metrics,
        **critic_metrics,
        **round_metrics,
        **stats,
        "peak_memory_mb": peak.megabytes(),
    })


def reincarnate(ctx: StepContext) -> None:
    """ReMix's policy reincarnation (Liang et al. 2025, arXiv:2507.06892, section 3.3), before the rollout
    of step ``algorithm.reincarnate_at``: the KL reference becomes the current policy (pi_base <- pi_theta)
    and a replaying rollout strategy replays nothing from this step on (on-policy from then on). Checked before the model loads: not with a LoRA policy (its
    reference is the adapter-free base) nor with an asynchronous generator (it runs ahead of the step)."""
    if ctx.reference is not None:
        ctx.reference.load_state_dict(unwrap(ctx.model).state_dict())
    ctx.strategy.stop_replay()


def stamp_policy_version(graded: GradedGroups, version: int) -> None:
    """Responses without a policy version were sampled now, by the policy after ``version`` updates."""
    for group in graded.groups:
        for completion in group:
            if completion.policy_version is None:
                completion.policy_version = version


def to_batch(ctx: StepContext, graded: GradedGroups) -> TrainBatch:
    """The graded groups as a padded batch with their (shaped) rewards and behaviour bookkeeping."""
    batch = collate(graded.groups, ctx.tokenizer.pad_token_id, ctx.device, current_version=ctx.policy_version)
    batch.rewards = graded.rewards.to(ctx.device)
    batch.correct = graded.correct.to(ctx.device).bool()
    if ctx.algorithm.kl_difficulty_scale is not None:  # CLPO's dynamic KL: each response's factor by its curriculum label
        batch.kl_scale = difficulty_kl_scale(response_labels(graded), ctx.algorithm.kl_difficulty_scale).to(ctx.device)
    if ctx.reference_rewards is not None:  # QRPO: each response's prompt's K pi_ref rewards (sampled once, cached)
        batch.reference_rewards = ctx.reference_rewards.rows(graded).to(ctx.device)
    if ctx.preference_model is not None:  # DRPO: r_phi of each response under the fitted preference model
        batch.preference_scores = ctx.preference_model.scores(graded).to(ctx.device)
    # from the step the reference became the policy on (reincarnate, before this step's rollout): SACPO's stage 2
    batch.reference_stage = 2 if ctx.reincarnate_at is not None and ctx.policy_version + 1 >= ctx.reincarnate_at else 1
    return batch


def behaviour_metrics(graded: GradedGroups, batch: TrainBatch) -> dict[str, float]:
    """Off-policy bookkeeping of the step (only when some response is not the policy's own sample):
    the share of trained tokens not sampled by pi_old, responses per behaviour label, and the
    staleness (policy versions behind the current one) of the oldest response."""
    labels = [c.behaviour for group in graded.groups for c in group]
    if not batch.has_off_policy and all(label == "policy" for label in labels):
        return {}
    mask = batch.response_mask
    off = batch.off_policy if batch.off_policy is not None else torch.zeros_like(mask)
    versions = batch.policy_version
    metrics = {
        "off_policy_token_fraction": float((off * mask).sum().item() / max(mask.sum().item(), 1.0)),
        "max_staleness": float((versions.max() - versions.min()).item()) if versions is not None else 0.0,
    }
    for label in sorted(set(labels)):
        metrics[f"responses_{label}"] = float(labels.count(label))
    return metrics


def behaviour_old_logp(batch: TrainBatch, recomputed: torch.Tensor) -> torch.Tensor:
    """pi_old for the ratio: the recomputed log-probs of the sampling policy on its own tokens, the
    behaviour policy's stored log-probs on off-policy tokens (never recomputed: a stale or replayed
    token's ratio is pi_theta / mu, not a silent 1). A trained off-policy token whose behaviour
    log-prob is unknown (NaN) is refused: its algorithm must supply pi_old for it first
    (rlbench.rollout.engines.base.Completion.behaviour_logprobs)."""
    if not batch.has_off_policy:
        return recomputed
    off = (batch.off_policy > 0) & (batch.response_mask > 0)
    unknown = off & batch.behaviour_logp.isnan()
    if bool(unknown.any()):
        raise ValueError(
            f"{int(unknown.sum())} trained off-policy tokens have no behaviour log-prob (NaN); set "
            "Completion.behaviour_logprobs where the tokens enter the batch (an algorithm that assumes "
            "a behaviour probability, e.g. LUFFY's mu = 1, writes it there)"
        )
    return torch.where(off, batch.behaviour_logp.to(recomputed.dtype), recomputed)


def advantage_inputs(ctx: StepContext, graded: GradedGroups, batch: TrainBatch) -> tuple[dict[str, Any], dict[str, float]]:
    """What the advantage estimator (and the KL-in-reward term) may read besides rewards and groups.

    A no-grad pass of the sampling policy runs only when the estimator reads log-probs or entropies,
    the batch is reused for several updates, or the KL / token mask / KL controller needs them; it
    stores old log-probs and values on the batch. Under algorithm.sampling_correction.bypass the old
    log-probs are the rollout engine's, and the pass runs only for what else needs it. Reference log-probs only when the KL term is
    active. With algorithm.sampling_correction.rejected_tokens=drop the rejected tokens then leave the
    response mask (sampling_correction.py). Then the inputs that need more than the batch
    (:class:`AdvantageInputSources`)."""
    algorithm = ctx.algorithm
    bypass = algorithm.bypasses_old_logp
    inputs: dict[str, Any] = {"correct": graded.correct.to(ctx.device).bool(), "max_length": ctx.params.max_new_tokens,
                              "outcome": graded.outcome.to(ctx.device)}
    policy_logp = None  # pi_old on the policy's own tokens
    if algorithm.needs_sampling_pass or (batch.has_off_policy and not bypass):
        before = batch_outputs(
            ctx.model, batch, ctx.micro_batch_size, ctx.temperature, with_entropy=algorithm.needs_sampling_entropy,
            value_head=ctx.update_state.value_head, with_sum_pi_squared=algorithm.needs_sampling_sum_pi_squared,
            value_model=None if ctx.update_state.critic is None else ctx.update_state.critic.model,
        )
        policy_logp = before.logp
        if algorithm.kl_previous_weight > 0:  # pi_prev: the policy before this update, on every token
            batch.prev_logp = before.logp
        inputs.update(entropy=before.entropy, values=before.values, sum_pi_squared=before.sum_pi_squared)
        batch.old_values = before.values
    if bypass:  # verl's bypass mode: pi_old is the rollout engine's log-probs (sampling_correction.py)
        policy_logp = batch.sampling_logp
    if policy_logp is not None:
        old_logp = behaviour_old_logp(batch, policy_logp)
        inputs["old_logp"] = old_logp
        if algorithm.needs_old_logp or batch.has_off_policy or bypass:
            batch.old_logp = old_logp
    dropped: dict[str, float] = {}
    if algorithm.drops_rejected_tokens and batch.sampling_logp is not None:  # verl's rejection sampling
        batch.response_mask, dropped = algorithm.sampling_correction.drop_rejected(
            batch.response_mask, batch.old_logp, batch.sampling_logp
        )
    metrics = dict(dropped)
    if ctx.reference is not None:  # before the sources: OPRL's implicit PRM reads log pi_ref
        batch.ref_logp = reference_log_probs(ctx.reference, batch, ctx.micro_batch_size, ctx.temperature, ctx.reference_cache)
        if ctx.reference_cache is not None:
            metrics.update(ctx.reference_cache.metrics())
    provided, measured = ctx.inputs.before_advantage(graded, batch)
    metrics.update(measured)
    inputs.update(provided)
    if ctx.dpo_policy is not None:  # RTO: log pi_dpo, one more frozen pass (arXiv:2404.18922 sec. 4)
        inputs["dpo_logp"] = reference_log_probs(ctx.dpo_policy, batch, ctx.micro_batch_size, ctx.temperature, None)
        log_ratio = ((inputs["dpo_logp"] - batch.ref_logp) * batch.response_mask).sum(-1)
        metrics["rto_dpo_log_ratio"] = log_ratio.mean().item()  # per response: log pi_dpo(y|x) / pi_ref(y|x)
    if ctx.rounds is not None:  # iterative rounds: the loss's pi_old is the round's frozen pi_t (training/rounds.py)
        batch.old_logp = ctx.rounds.log_probs(batch, ctx.micro_batch_size, ctx.temperature)
    return inputs, metrics


def compute_advantages(
    ctx: StepContext, batch: TrainBatch, inputs: dict[str, Any], progress: float = 0.0
) -> torch.Tensor | None:
    """Sets the batch's token mask, advantages and (with a critic) value targets, then, with
    algorithm.downsampling (D3S), the responses and tokens the update trains on, chosen from the
    advantages of the full groups; returns the per-response KL to the reference when the KL is placed
    in the reward or controlled adaptively."""
    algorithm = ctx.algorithm
    rewards, response_kl = batch.rewards, None
    if algorithm.rto is not None:  # RTO: the DPO token reward, the KL penalty and the sparse reward per token
        rewards, inputs["token_rewards"], response_kl = algorithm.rto_reward_terms(
            batch.rewards, batch.response_mask, inputs.get("old_logp"), batch.ref_logp, inputs["dpo_logp"]
        )
    elif algorithm.kl_in_reward or algorithm.kl_adaptive is not None:
        rewards, inputs["token_rewards"], response_kl = algorithm.kl_reward_terms(
            batch.rewards, batch.response_mask, inputs["old_logp"], batch.ref_logp
        )
    batch.token_weights = algorithm.token_weights(inputs.get("entropy"), batch.response_mask)
    wanted = algorithm.advantage_inputs | ctx.inputs.needs
    batch.advantages = algorithm.compute_advantages(
        rewards, batch.group_index, batch.response_mask, **{k: inputs.get(k) for k in wanted}
    )
    if ctx.update_state.has_critic:  # the critic's targets: GAE lambda-returns of the same values
        batch.returns = value_targets(
            algorithm.advantage.params, rewards, batch.old_values, batch.response_mask, inputs.get("token_rewards"),
            advantage=algorithm.advantage.name, step_index=inputs.get("step_index"),
        )
    if algorithm.downsampling is not None:
        batch.sample_keep, batch.token_weights = algorithm.downsampling.apply(
            batch.advantages, batch.group_index, batch.response_mask, inputs.get("entropy"), progress
        )
    return response_kl


def update(
    ctx: StepContext, batch: TrainBatch, finished: torch.Tensor, progress: float, response_kl: torch.Tensor | None
) -> dict[str, float]:
    """The update schedule on the batch (DAPO's overlong filter masks truncated responses first; D3S
    keeps the responses it selected), then the adaptive coefficients, the lr schedule and the engine's weights. Adds
    ``trainable_tokens``: the tokens the loss could move (0: this step learned nothing)."""
    algorithm = ctx.algorithm
    trained = kept_responses(mask_truncated(batch, finished) if ctx.overlong_filter else batch)
    if algorithm.pf_ppo is not None:  # PF-PPO: the batch re-sampled by reward, from the mini-batch stream
        trained = trained.select(algorithm.pf_ppo.rows(trained.rewards, ctx.minibatch_generator))
    stats = apply_update_schedule(
        ctx.model,
        ctx.optimizer,
        trained,
        algorithm,
        ctx.update_state,
        micro_batch_size=ctx.micro_batch_size,
        max_grad_norm=ctx.max_grad_norm,
        temperature=ctx.temperature,
        norm_length=ctx.params.max_new_tokens,
        generator=ctx.minibatch_generator,
        progress=progress,
        loss_streams=LossStreams(ctx.seed, ctx.policy_version, ctx.world.rank),
    )
    faults.kill_point("update")
    stats["trainable_tokens"] = float(trainable_tokens(trained))
    entropy = stats.get("entropy")
    algorithm.update_coefficients(
        None if response_kl is None else response_kl.mean().item(),
        None if entropy is None or math.isnan(entropy) else entropy,  # no token, no entropy to steer by
        batch.size,
    )
    if algorithm.uses_optimizer:
        ctx.scheduler.step()
    ctx.engine.sync_weights(unwrap(ctx.model))
    return stats


def step_metrics(graded: GradedGroups, batch: TrainBatch, response_kl: torch.Tensor | None) -> dict[str, float]:
    """Rewards, accuracy, advantages and lengths of the step's batch."""
    grades, rewards, finished = graded.grades, batch.rewards, graded.finished
    lengths = batch.response_mask.sum(-1)
    sequence_adv = batch.advantages[:, 0]
    group_std = torch.stack([rewards[batch.group_index == g].std(correction=0) for g in range(len(graded.groups))])
    return {
        "reward_mean": rewards.mean().item(),
        "outcome_mean": graded.outcome.mean().item(),  # the graders' reward, before reward shaping
        "reward_std": rewards.std().item() if len(rewards) > 1 else 0.0,
        "accuracy": float(np.mean([g.correct for g in grades])),
        "format_rate": float(np.mean([g.format_ok for g in grades])),
        "frac_zero_std_groups": float((group_std.nan_to_num(0.0) == 0).float().mean().item()),
        "advantage_mean": sequence_adv.mean().item(),
        "advantage_std": sequence_adv.std().item() if len(sequence_adv) > 1 else 0.0,
        "advantage_abs_mean": sequence_adv.abs().mean().item(),
        "response_length": lengths.float().mean().item(),
        "truncated_rate": float(1.0 - finished.float().mean().item()),
        "reward_shaping_mean": (rewards - graded.outcome.to(rewards.device)).mean().item(),
        **({"kl_sequence": response_kl.mean().item()} if response_kl is not None else {}),
        **({"token_mask_kept": (batch.token_weights.sum() / lengths.sum().clamp(min=1)).item()}
           if batch.token_weights is not None else {}),
        # the effective batch: the responses the update trained on (D3S keeps a subset)
        **({"trained_responses": float(batch.sample_keep.sum().item())} if batch.sample_keep is not None else {}),
        "grader_errors": float(sum(g.error is not None for g in grades)),
    }
