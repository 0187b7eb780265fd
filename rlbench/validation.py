"""Validation of a composed run configuration, before any model or data is loaded (the run layer).

First every key and value is checked against the typed schemas (rlbench/config/walk.py, given what
the registries hold: :func:`registered`), then the cross-field checks below run; they need the
algorithm, rollout and training code, which is why they live here and not beside the schema. Every check raises :class:`ConfigError` (or :class:`DataError` for
files) with a message that names the key(s) and says what to change.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from omegaconf import DictConfig

from rlbench.algorithm import Algorithm
from rlbench.algorithm.pieces import PIECE_KINDS
from rlbench.algorithm.registry import ADVANTAGES, POLICY_LOSSES
from rlbench.algorithm.rto import check_rto_run
from rlbench.algorithm.shaping import REWARD_SHAPING
from rlbench.config.fit import check_fits_here
from rlbench.config.origin import ValueOrigins, with_origins
from rlbench.config.schema import (
    DatasetConfig,
    FidelityConfig,
    RunConfig,
    SandboxConfig,
    WarmupConfig,
)
from rlbench.config.typed import algorithm_settings, typed_config
from rlbench.config.walk import Registered, check_against_schema
from rlbench.dataset import validate_spec
from rlbench.errors import ConfigError
from rlbench.guidance import GuidanceOptions
from rlbench.model import validate_model_config
from rlbench.reward.terms import check_reward_config
from rlbench.rollout import STRATEGIES
from rlbench.rollout.env import ENVIRONMENTS, env_roles, validate_env
from rlbench.rollout.guided.difficulty_adaptive import DifficultyOptions
from rlbench.rollout.guided.replay import check_pool_problems, check_replay_pool, generated_pool_path
from rlbench.rollout.strategies.multi_turn import MultiTurnOptions
from rlbench.rollout.strategies.rethink import check_success_training
from rlbench.training.advantage_inputs import validate_step_options
from rlbench.training.aux_tasks import check_aux_tasks
from rlbench.training.curricula import PROMPT_SAMPLERS, sampler_options
from rlbench.training.distributed import check_parallelism, launched_world_size
from rlbench.training.reference_soup import validate_reference_soup
from rlbench.training.preference_model import check_preference_model
from rlbench.training.step_critic import check_step_critic
from rlbench.training.stages import SAMPLER_KEY, parse_stages, stage_settings
from rlbench.training.swarm import check_swarm


def registered() -> Registered:
    """What the registries hold, for the schema walk: the algorithm pieces, the rollout strategies
    (``rollout.<strategy>`` blocks) and the prompt samplers (``trainer.prompt_sampler.<name>`` blocks)."""
    return Registered(pieces=PIECE_KINDS,
                      choices={"rollout.strategy": list(STRATEGIES), "trainer.prompt_sampler.name": list(PROMPT_SAMPLERS),
                               "env.name": list(ENVIRONMENTS)})

log = logging.getLogger(__name__)


def _positive(value: Any, key: str) -> None:
    if value is None or value <= 0:
        raise ConfigError(f"{key} must be a positive number, got {value}")


def resolve_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={requested} but CUDA is not available; use device=auto or device=cpu")
    return torch.device(requested)


def check_batch_arithmetic(prompts_per_step: int, n: int, micro_batch_size: int, minibatches: int) -> None:
    """The batch of prompts_per_step * n responses must split into equal mini-batches, and each
    mini-batch into equal micro-batches (a mini-batch no larger than micro_batch_size is one)."""
    _positive(prompts_per_step, "trainer.prompts_per_step")
    _positive(n, "rollout.n")
    _positive(micro_batch_size, "trainer.micro_batch_size")
    batch = prompts_per_step * n
    if batch % minibatches:
        raise ConfigError(
            f"batch of trainer.prompts_per_step * rollout.n = {prompts_per_step} * {n} = {batch} responses "
            f"cannot be split into algorithm.update.minibatches={minibatches} equal mini-batches; "
            f"choose minibatches dividing {batch}"
        )
    per_minibatch = batch // minibatches
    if per_minibatch > micro_batch_size and per_minibatch % micro_batch_size:  # smaller: one micro-batch
        divisors = [d for d in range(1, per_minibatch + 1) if per_minibatch % d == 0]
        raise ConfigError(
            f"mini-batch of {per_minibatch} responses (prompts_per_step * n / minibatches) is not a multiple of "
            f"trainer.micro_batch_size={micro_batch_size}; use one of {divisors}"
        )


def check_curriculum(config: RunConfig, algorithm: Algorithm) -> None:
    """The prompt sampler's options, the difficulty filter's band, and the stages (ordered, known keys) with every
    stage's batch and sampler."""
    trainer = config.trainer
    sampler_options(trainer.prompt_sampler)
    if trainer.prompt_sampler is not None and trainer.prompt_sampler.name == "spo" and algorithm.advantage.name != "spo":
        raise ConfigError(
            f"trainer.prompt_sampler=spo draws prompts by the SPO value tracker's uncertainty, and advantage "
            f"'{algorithm.advantage.name}' keeps no tracker: use algorithm=spo, or another prompt_sampler"
        )
    check_aux_tasks(trainer, config.rollout, config.reward)
    if trainer.prompt_sampler is not None and trainer.prompt_sampler.name == "clpo" and (
            trainer.parallelism != "single" or trainer.max_staleness is not None):
        raise ConfigError("trainer.prompt_sampler=clpo needs trainer.parallelism=single and trainer.max_staleness=null "
                          "(the policy rewrites the step's problems after its rollout; each process or the generator "
                          "thread would keep a rewrite pool of its own)")
    clpo = trainer.prompt_sampler is not None and trainer.prompt_sampler.name == "clpo"
    if algorithm.kl_difficulty_scale is not None and not clpo:
        raise ConfigError("algorithm.kl.difficulty_scale scales each response's KL by its curriculum difficulty label, "
                          "which prompt_sampler=clpo gives (CLPO's dynamic KL); use it, or every factor 1")
    if clpo:
        options = sampler_options(trainer.prompt_sampler)[1]
        if options.mixing == "same_step" and options.verify_samples not in (None, config.rollout.n):
            raise ConfigError(f"trainer.prompt_sampler.clpo.verify_samples={options.verify_samples}: with mixing=same_step a "
                              f"rewrite's answers train as its group beside the step's, so they number rollout.n={config.rollout.n}")
    band = trainer.difficulty_filter
    if band is not None and band.model is not None:
        try:  # the model the filter samples, refused before anything loads
            validate_model_config(band.model)
        except ConfigError as err:
            raise ConfigError(f"trainer.difficulty_filter.model: {err}") from None
    if band is not None and band.min_pass_rate > band.max_pass_rate:
        raise ConfigError(f"trainer.difficulty_filter: min_pass_rate={band.min_pass_rate} is above "
                          f"max_pass_rate={band.max_pass_rate}, so no problem could be kept")
    if band is not None and trainer.parallelism != "single":
        raise ConfigError(f"trainer.difficulty_filter is not supported with trainer.parallelism={trainer.parallelism} "
                          "(each process would filter the problems by its own samples)")
    stages = parse_stages(trainer.stages, trainer.steps)
    triggered = [stage.label for stage in stages if stage.when is not None]
    if triggered and (trainer.parallelism != "single" or trainer.max_staleness is not None):
        raise ConfigError(f"trainer.stages {triggered[0]}: a stage that starts on a metric needs "
                          "trainer.parallelism=single and trainer.max_staleness=null (each process or actor would "
                          "decide from its own metrics; a generator thread samples before the metric is known); "
                          "give the stage a step (at: N)")
    for stage, settings in zip(stages, stage_settings(config, stages)):
        try:
            sampler_options(settings[SAMPLER_KEY])
            check_batch_arithmetic(settings["trainer.prompts_per_step"], settings["rollout.n"],
                                   trainer.micro_batch_size, algorithm.minibatches)
            algorithm.check_group_size(settings["rollout.n"], settings["trainer.prompts_per_step"] * settings["rollout.n"])
        except ConfigError as err:
            raise ConfigError(f"from trainer.stages {stage.label}: {err}") from None


def check_sharded_run_features(config: RunConfig) -> None:
    """Under trainer.parallelism=ddp|fsdp|swarm the asynchronous pipeline is not carried to several
    processes yet (refused). Under ddp|fsdp every stage's trainer.prompts_per_step must split into
    whole groups per rank. (Prompt samplers work: the ranks gather their groups' statistics every step;
    a swarm's actors are whole runs, each with its own sampler, checkpoints and stages, and
    rlbench.training.swarm.check_swarm checks every stage's shared groups.)"""
    trainer = config.trainer
    strategy = trainer.parallelism
    if strategy == "single":
        return
    if trainer.max_staleness is not None:
        raise ConfigError(f"trainer.parallelism={strategy} does not support trainer.max_staleness yet; "
                          "use trainer.parallelism=single for it")
    if strategy == "swarm":  # every actor is a whole run of its own: nothing is split over the ranks
        return
    if strategy == "fsdp" and config.algorithm.update.round_steps is not None:
        raise ConfigError("algorithm.update.round_steps keeps a whole frozen copy of the policy (pi_t) on each rank, which "
                          "trainer.parallelism=fsdp does not shard yet: use trainer.parallelism=ddp or single")
    world_size = launched_world_size()
    stages = parse_stages(trainer.stages, trainer.steps)
    for stage, settings in zip(stages, stage_settings(config, stages)):
        if settings["trainer.prompts_per_step"] % world_size:
            raise ConfigError(
                f"from trainer.stages {stage.label}: the world size {world_size} does not divide "
                f"trainer.prompts_per_step={settings['trainer.prompts_per_step']}; every rank trains on the same "
                "number of whole groups: use a multiple of the number of processes"
            )


def check_staleness(config: RunConfig, algorithm: Algorithm) -> None:
    """Training on stale data (trainer.max_staleness >= 1) is refused with a piece that needs on-policy
    data, advantage inputs that sample at the learner, stages and periodic evaluation
    (rlbench/training/async_pipeline.py says why)."""
    trainer = config.trainer
    k = trainer.max_staleness
    if k is not None and (trainer.checkpoint_every or config.resume):
        raise ConfigError(f"trainer.max_staleness={k} runs the asynchronous pipeline, which writes no checkpoint "
                          "(its generator runs ahead of the learner): drop trainer.checkpoint_every and resume, "
                          "or use trainer.max_staleness=null")
    j = trainer.weight_sync_every
    if j > 1 and k is None:
        raise ConfigError(f"trainer.weight_sync_every={j} syncs the generator thread's weights every {j} versions, "
                          "but trainer.max_staleness=null runs no generator thread: set trainer.max_staleness >= "
                          f"{j - 1} or weight_sync_every=1")
    if k is not None and j > k + 1:
        raise ConfigError(f"trainer.weight_sync_every={j} with trainer.max_staleness={k}: batch s must be sampled by a "
                          f"synced version (a multiple of {j}) at most {k} versions behind the learner, and {k + 1} "
                          f"consecutive versions hold a multiple of {j} only if weight_sync_every <= max_staleness + 1: "
                          f"set trainer.max_staleness >= {j - 1} or trainer.weight_sync_every <= {k + 1}")
    if k is None or k == 0:
        return
    where = f"trainer.max_staleness={k} trains on data up to {k} policy versions old"
    if algorithm.on_policy_requirements:
        raise ConfigError(f"{where}, but algorithm '{algorithm.name}' needs on-policy data: "
                          + "; ".join(algorithm.on_policy_requirements) + ". Use trainer.max_staleness=null or 0")
    if "baseline_rewards" in ADVANTAGES.accepted_inputs(algorithm.advantage.name):
        raise ConfigError(f"{where}; advantage '{algorithm.advantage.name}' samples baseline rollouts at the learner, "
                          "which shares the engine with the generator thread: use trainer.max_staleness=null or 0")
    if trainer.stages:
        raise ConfigError(f"{where}; trainer.stages would change the sampling settings while older batches are "
                          "trained: use stages only with trainer.max_staleness=null or 0")
    if config.eval.every:
        raise ConfigError(f"{where}; eval.every evaluates during training on the engine the generator thread "
                          "samples with: set eval.every=null (the evaluation after training still runs)")
    if algorithm.round_steps is not None and algorithm.round_sampling == "pi_t":
        raise ConfigError(f"{where}; algorithm.update.round_sampling=pi_t samples each round with the round's frozen "
                          "pi_t, which the generator thread, running ahead of the rounds, cannot know: use "
                          "algorithm.update.round_sampling=policy or trainer.max_staleness=null")
    if config.algorithm.reincarnate_at is not None:
        raise ConfigError(f"{where}; algorithm.reincarnate_at switches to on-policy data at a step the generator "
                          "thread has already sampled ahead of: use it with trainer.max_staleness=null or 0")


def notice_inactive_terms(config: RunConfig, algorithm: Algorithm) -> str | None:
    """The start-up line of a training run whose loss's distinguishing term cannot act: the loss declares
    a term that acts only where pi_theta / pi_old differs from 1 (registry.Needs.ratio_term) and the run
    takes one update per batch (``Algorithm.updates_per_batch``) on fresh data (no trainer.max_staleness),
    so every token the policy sampled has ratio 1 and the run trains the base loss. Logged as a warning
    and returned; None (nothing logged) when the term can act or the run does not train."""
    term = POLICY_LOSSES.ratio_term(algorithm.loss.name, algorithm.loss.params)
    stale = (config.trainer.max_staleness or 0) >= 1
    # bypass: pi_old is the engine's, off 1 by the engine/trainer mismatch (near 0 only with the HF engine)
    stale = stale or (algorithm.bypasses_old_logp and config.rollout.engine != "hf")
    if term is None or stale or algorithm.updates_per_batch != 1 or config.mode != "train" or not config.trainer.steps:
        return None
    line = (f"algorithm '{algorithm.name}': {term} (loss '{algorithm.loss.name}') acts only where pi_theta / pi_old "
            "differs from 1, and this run takes one update per batch on fresh data (algorithm.update epochs x "
            "minibatches = 1, no trainer.max_staleness): every sampled token has ratio 1, so that term is inactive "
            "and the run trains the base loss; raise algorithm.update.minibatches or epochs, or set "
            "trainer.max_staleness, to exercise it")
    log.warning(line)
    return line


def fidelity_blocks(config: RunConfig) -> list[tuple[str, FidelityConfig]]:
    """(how the preset is named in a message, its block) for every preset of the run that states its fidelity:
    the paper (``paper=<name>``), the algorithm, the rollout strategy, the prompt sampler and the reward, in that order.
    A block's ``method`` names the method where the node's own name does not (``rollout=replay_rlep`` composes
    the strategy ``replay``)."""
    paper = config.paper or {}
    nodes = [
        (f"paper={paper.get('name')}", paper.get("fidelity")),
        (f"algorithm={config.algorithm.name}", config.algorithm.fidelity),
        (f"rollout={config.rollout.strategy}", config.rollout.fidelity),
        (f"prompt_sampler={config.trainer.prompt_sampler.name}", config.trainer.prompt_sampler.fidelity),
        (f"reward={config.reward.name}", config.reward.fidelity),
    ]
    return [(f"{label} ({block.method})" if block.method else label, block) for label, block in nodes if block is not None]


def check_fidelity(config: RunConfig) -> None:
    """Each stated fidelity of the run carries the text its status needs (:func:`fidelity_problem`)."""
    for label, block in fidelity_blocks(config):
        problem = fidelity_problem(block)
        if problem:
            raise ConfigError(f"{label}: fidelity.status={block.status} {problem}")


def fidelity_problem(block: FidelityConfig) -> str | None:
    """What a fidelity block lacks or holds wrongly, or None: ``missing`` (what is not built and what runs
    instead) with partial and only with it, ``adapted`` (how the setting changed) with adapted (a partial
    preset may say it too), neither with faithful (docs/papers.md, "Fidelity")."""
    def said(text: str | None) -> bool:
        return bool(text and text.strip())

    if block.status is None:
        return "needs fidelity.status: faithful, partial or adapted"
    if block.status == "partial" and not said(block.missing):
        return "needs fidelity.missing: what part of the method is not built and what runs instead"
    if block.status != "partial" and block.missing is not None:
        return "takes no fidelity.missing (only a partial preset lacks part of its method)"
    if block.status == "adapted" and not said(block.adapted):
        return "needs fidelity.adapted: how the method was carried to another setting than the paper's"
    if block.status == "faithful" and block.adapted is not None:
        return "takes no fidelity.adapted (a preset carried to another setting is status adapted)"
    return None


def notice_fidelity(config: RunConfig) -> list[str]:
    """The start-up lines of a run that composes a partial or adapted preset, one per preset (logged as
    warnings and returned; none outside mode=train): ``paper=pvpo is partial: <missing>``, ``paper=edit_grpo
    is adapted: <how>``. A user who runs a preset named after a method learns before training that the run is
    not all of that method, or not in its setting."""
    if config.mode != "train":
        return []
    lines = []
    for label, block in fidelity_blocks(config):
        if block.status != "faithful":
            text = block.missing if block.status == "partial" else block.adapted
            lines.append(f"{label} is {block.status}: {' '.join(text.split())}")
    for line in lines:
        log.warning(line)
    return lines


def check_per_role_lora(config: RunConfig) -> None:
    """``model.lora.per_role`` (an adapter per role, rlbench/model/lora.py), refused before the model loads where
    it cannot be what it says: without an environment whose roles take turns; with an engine that cannot
    switch adapters per request (vllm loads merged weights); with several ranks (each role's forward is a
    collective of its own, whose count would differ between ranks); with the merged save (two adapters do
    not merge into one model); with what samples or scores without naming a role (rollout.multi_turn.branch=
    entropy_tool's entropies, a policy judge); with a separate critic (a copy of the policy, role adapters
    included)."""
    lora = config.model.lora
    if lora is None or not lora.per_role:
        return
    roles = env_roles(config.env)
    fix = "drop model.lora.per_role (one adapter for every role)"
    if len(roles) < 2:
        where = f"env={config.env.name} has one role" if config.env is not None else "no env= is set"
        raise ConfigError(f"model.lora.per_role=true gives each role of the environment its own adapter, but {where}: "
                          f"use an environment whose roles take turns (env=proposer_verifier), or {fix}")
    conflicts = {
        "rollout.engine=vllm (it samples from merged weights and cannot switch adapters per turn; use rollout.engine=hf)":
            config.rollout.engine == "vllm",
        f"trainer.parallelism={config.trainer.parallelism} (one forward per role would pair collectives unevenly "
        "across ranks; use trainer.parallelism=single)": config.trainer.parallelism != "single",
        "model.lora.merge_on_save=true (the role adapters do not merge into one model)": bool(lora.merge_on_save),
        "rollout.multi_turn.branch=entropy_tool (its entropies are scored without a role)":
            config.rollout.strategy == "multi_turn" and MultiTurnOptions.from_config(config.rollout).branch == "entropy_tool",
        "reward.judge.kind=policy (the policy judges without a role)":
            config.reward.judge is not None and config.reward.judge.kind == "policy",
        "algorithm.critic.model=separate (the critic copies the policy: its role adapters would train one role's "
        "values at a time; use algorithm.critic.model=shared)":
            config.algorithm.critic is not None and config.algorithm.critic.model == "separate",
    }
    for what, conflict in conflicts.items():
        if conflict:
            raise ConfigError(f"model.lora.per_role=true (an adapter per role of env={config.env.name}) does not combine "
                              f"with {what}; or {fix}")


def check_reincarnation(config: RunConfig, algorithm: Algorithm) -> None:
    """ReMix's policy reincarnation (algorithm.reincarnate_at) copies the policy into the KL reference:
    not with a LoRA policy, whose reference is the adapter-free base (a view, no copy to overwrite).
    A loss with stages of reference (``reference_stage``: SACPO) needs the step its stage 2 starts at."""
    at = config.algorithm.reincarnate_at
    if algorithm.loss_has_stages:
        if at is None:
            raise ConfigError(f"the '{algorithm.loss.name}' loss trains in two stages, the second against the policy as it "
                              "is at the stage switch: set algorithm.reincarnate_at to the step stage 2 starts at")
        if config.model.lora is not None:
            raise ConfigError(f"the '{algorithm.loss.name}' loss makes the policy the reference at "
                              f"algorithm.reincarnate_at={at}, but a LoRA policy's reference is its adapter-free base: "
                              "drop model/lora")
    if at is not None and config.algorithm.reference_soup is not None:
        raise ConfigError(f"algorithm.reincarnate_at={at} and algorithm.reference_soup both set the KL reference "
                          "(ReMix's reincarnated policy, SALSA's weight soup): choose one")
    if at is not None and config.model.lora is not None and config.algorithm.kl.coef > 0:
        raise ConfigError(f"algorithm.reincarnate_at={at} makes the policy the new KL reference, but a LoRA policy's "
                          "reference is its adapter-free base: drop model.lora, algorithm.kl.coef or reincarnate_at")


def check_masked_rollout(config: RunConfig, algorithm: Algorithm) -> None:
    """rollout=masked changes every forward of the step to the masked distribution (rlbench/rollout/strategies/masked.py):
    refused where a batch could be trained under another mask than it was sampled with, or where a term
    reads the whole vocabulary's log-probs, -inf outside the mask."""
    if config.rollout.strategy != "masked":
        return
    k = config.trainer.max_staleness
    if k:
        raise ConfigError(f"trainer.max_staleness={k}: rollout=masked trains a batch with the mask of the policy copy "
                          "that sampled it, which the generator thread may have refreshed since: use "
                          "trainer.max_staleness=null or 0")
    if algorithm.schedule == "trpo":
        raise ConfigError("rollout=masked gives the tokens outside the mask log-prob -inf, where the trpo schedule's KL "
                          "over the whole vocabulary is undefined: use another update schedule")


def check_edge_gec_rollout(config: RunConfig, algorithm: Algorithm) -> None:
    """rollout=edge_gec (rlbench/rollout/guided/edge_gec.py) declares its injected text the policy's own, pi_old
    recomputed before the update; no sampler scored that text, so nothing may read its placeholder sampling
    log-probs as a behaviour probability: neither a sampling correction nor stale (asynchronous) training."""
    if config.rollout.strategy != "edge_gec":
        return
    if algorithm.sampling_correction is not None:
        raise ConfigError("rollout=edge_gec injects text no sampler scored (its pi_old is recomputed by the trainer), "
                          "which algorithm.sampling_correction would weigh by a sampling log-prob it does not have: "
                          "set algorithm.sampling_correction=null")
    if config.trainer.max_staleness:
        raise ConfigError(f"rollout=edge_gec with trainer.max_staleness={config.trainer.max_staleness}: a stale "
                          "corrected response would take its injected text's placeholder log-probs as pi_old; "
                          "use trainer.max_staleness=null or 0")


def check_difficulty_rollout(config: RunConfig, algorithm: Algorithm) -> None:
    """rollout=difficulty_adaptive (rlbench/rollout/guided/difficulty_adaptive.py) at every stage's group size,
    the smallest batch it can form (every prompt easy: prompts_per_step * n_min responses) against the
    mini-batches, and response budgets that vary against reward shaping that reads the budget."""
    rollout, trainer = config.rollout, config.trainer
    if rollout.strategy != "difficulty_adaptive":
        return
    options = DifficultyOptions.from_config(rollout)
    stages = parse_stages(trainer.stages, trainer.steps)
    settings = [{"rollout.n": rollout.n, "trainer.prompts_per_step": trainer.prompts_per_step}]
    for stage, setting in zip(stages, stage_settings(config, stages)):
        try:
            options.check(int(setting["rollout.n"]))
        except ConfigError as err:
            raise ConfigError(f"from trainer.stages {stage.label}: {err}") from None
        settings.append(setting)
    for setting in settings:
        smallest = int(setting["trainer.prompts_per_step"]) * options.n_min
        if smallest < algorithm.minibatches:
            raise ConfigError(
                f"rollout=difficulty_adaptive: with every prompt easy a step has trainer.prompts_per_step * n_min = "
                f"{setting['trainer.prompts_per_step']} * {options.n_min} = {smallest} responses, fewer than "
                f"algorithm.update.minibatches={algorithm.minibatches}: raise n_min or prompts_per_step, or lower minibatches"
            )
    budget_readers = sorted(s.name for s in algorithm.reward_shaping if "max_length" in REWARD_SHAPING.accepted_inputs(s.name))
    if budget_readers and (options.hard_length_scale != 1 or options.easy_length_scale != 1):
        raise ConfigError(
            f"rollout=difficulty_adaptive gives prompts different response budgets, but reward shaping {budget_readers} "
            "reads one budget (max_length) for the whole step: set rollout.difficulty_adaptive.hard_length_scale=1 "
            "and easy_length_scale=1, or drop that shaping"
        )


def check_sandbox(sandbox: SandboxConfig) -> None:
    """The sandbox limits (checked by SandboxLimits itself) and the worker count."""
    from rlbench.sandbox import limits_from_config

    try:
        limits_from_config(sandbox)
    except ConfigError as err:
        raise ConfigError(f"{err} (set it with sandbox.<limit>=...)") from None
    workers = sandbox.workers
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ConfigError(f"sandbox.workers must be a positive integer or null (one per core), got {workers!r}")


def check_reward_matches_dataset(reward: str, dataset: DatasetConfig) -> None:
    """reward=code trains on code datasets (tests), reward=math on answer datasets, reward=fapo_genrm on
    dataset=flaw_steps (labelled step-split solutions); the toy reward
    (even_tokens) ignores answers and goes with any dataset (a dataset without answer_type is read as math)."""
    answer_type = dataset.answer_type or "math"
    if reward == "fapo_genrm" and dataset.loader != "flaw_steps":
        raise ConfigError(f"reward=fapo_genrm grades the GenRM's step index against a step-split solution's label; "
                          f"dataset={dataset.name} has none: use dataset=flaw_steps")
    if reward == "code" and answer_type != "code":
        raise ConfigError(
            f"reward=code runs tests, but dataset={dataset.name} has answers (answer_type {answer_type}); "
            "use reward=math, or a code dataset such as dataset=mbpp"
        )
    if reward == "math" and answer_type == "code":
        raise ConfigError(
            f"dataset={dataset.name} is graded by running tests; use reward=code (reward=math checks answers)"
        )


def check_warmup(warmup: WarmupConfig) -> None:
    """mode=generate's warm-up data (rlbench/guidance/warmup.py): both teachers given and loadable (a path that
    exists, a package installed), two different control tokens; before any model loads."""
    for mode, role in (("think", "the reasoning teacher"), ("short", "the concise teacher")):
        teacher = getattr(warmup, mode)
        if teacher is None or teacher.source is None:
            raise ConfigError(f"warmup.{mode} ({role}) is not set: add +model@warmup.{mode}=<option> (a conf/model/ option, "
                              f"e.g. +model@warmup.{mode}=checkpoint warmup.{mode}.path=<dir>)")
        try:
            validate_model_config(teacher)
        except ConfigError as err:
            raise ConfigError(f"warmup.{mode} ({role}): {err}".replace("model.", f"warmup.{mode}.")) from None
    if not warmup.think_token or not warmup.short_token or warmup.think_token == warmup.short_token:
        raise ConfigError(f"warmup.think_token={warmup.think_token!r} and warmup.short_token={warmup.short_token!r} must be "
                          "two different, non-empty control tokens")


def validate_config(cfg: DictConfig) -> Algorithm:
    """Check the whole run configuration. Returns the built Algorithm. Every refusal says where the
    keys it names were set (the command line, or a YAML file and its group option)."""
    origins = ValueOrigins.from_hydra()
    try:
        return check_run(cfg, origins)
    except ConfigError as err:
        raise ConfigError(with_origins(str(err), cfg, origins)) from None


def check_generate_output(config: RunConfig) -> None:
    """``mode=generate`` writes one file: graded traces to ``out``, or RLEP's pool of verified successes to
    ``rollout.replay.pool_save`` (rlbench.guidance.generate)."""
    pool = generated_pool_path(config.rollout)
    if not config.out and pool is None:
        raise ConfigError("mode=generate writes graded traces to a file: set out=<path>.jsonl (or RLEP's pool of "
                          "verified successes: rollout=replay_rlep_collect rollout.replay.pool_save=<file>)")
    if config.out and pool is not None:
        raise ConfigError(f"mode=generate writes one file: out={config.out} (graded traces) or "
                          f"rollout.replay.pool_save={pool} (RLEP's pool): set one of them")
    if pool is not None and config.guidance is not None and config.guidance.keep_incorrect:
        raise ConfigError("rollout.replay.pool_save: RLEP's pool holds verified successes only; "
                          "guidance.keep_incorrect=true is for the traces file (out=)")


def check_run(cfg: DictConfig, origins: ValueOrigins) -> Algorithm:
    """The schema walk checks every key, type, choice and bound (rlbench/config/schema.py); the
    checks here relate several keys, or need the registry, the files or the device. They read the
    config as the schema's dataclasses (rlbench.config.typed, the run's one conversion); the dataset
    specs go to their loader's check as composed."""
    check_against_schema(cfg, registered(), origins)
    config = typed_config(cfg)
    check_fidelity(config)
    validate_env(config.env, config.rollout.strategy, config.mode)
    check_per_role_lora(config)
    if config.env is not None and config.eval.rounds > 1:
        raise ConfigError(f"eval.rounds={config.eval.rounds} (multi-round inference) does not combine with env={config.env.name} "
                          "(each sample is an episode through the environment); set eval.rounds=1")
    if config.eval.self_reflection and (config.env is not None or config.eval.rounds > 1):
        raise ConfigError("eval.self_reflection=true (SPARK's judge-then-revise loop on each sample) needs single-turn samples: "
                          "it does not combine with " + (f"env={config.env.name} (each sample is an episode)" if config.env is not None
                                                         else f"eval.rounds={config.eval.rounds} (multi-round inference)"))
    if config.eval.judge_accuracy and (config.env is not None or config.trainer.parallelism in ("ddp", "fsdp")):
        raise ConfigError("eval.judge_accuracy=true (SPARK's judge on the evaluation's samples) needs single-turn "
                          "samples in one process: it does not combine with "
                          + (f"env={config.env.name} (each sample is an episode)" if config.env is not None
                             else f"trainer.parallelism={config.trainer.parallelism}"))
    device = resolve_device(config.device)
    algorithm = Algorithm.from_config(algorithm_settings(config.algorithm))

    rollout = config.rollout
    if rollout.engine == "vllm" and device.type != "cuda":
        raise ConfigError("rollout.engine=vllm needs a CUDA device; use rollout.engine=hf on CPU")

    if config.mode == "train":
        trainer = config.trainer
        if algorithm.group_relative and rollout.n < 2:
            raise ConfigError(
                f"algorithm '{algorithm.name}' uses the group-relative advantage '{algorithm.advantage.name}', "
                f"which needs rollout.n >= 2 responses per prompt (got {rollout.n})"
            )
        check_batch_arithmetic(trainer.prompts_per_step, rollout.n, trainer.micro_batch_size, algorithm.minibatches)
        check_curriculum(config, algorithm)
        check_staleness(config, algorithm)
        check_reincarnation(config, algorithm)
        check_masked_rollout(config, algorithm)
        check_difficulty_rollout(config, algorithm)
        check_edge_gec_rollout(config, algorithm)
        if algorithm.sampling_correction is not None:
            algorithm.sampling_correction.check_rollout(rollout.top_p)
        algorithm.check_batch_size(trainer.prompts_per_step * rollout.n)
        algorithm.check_group_size(rollout.n, trainer.prompts_per_step * rollout.n)
        validate_step_options(config, algorithm)
        check_step_critic(config)
        check_preference_model(config)
        validate_reference_soup(config, algorithm.kl_coef)
        if algorithm.reference_samples and config.reward.judge is not None:
            raise ConfigError("algorithm.qrpo.reference_samples grades pi_ref's samples once and caches their rewards, which "
                              "a model judge's verdicts (stateful, budgeted per step) are not: use reward terms without "
                              "reward.judge, or algorithm.qrpo.reference_samples=0")
        if algorithm.reference_samples and (config.model.lora is not None or trainer.parallelism == "fsdp"):
            raise ConfigError("algorithm.qrpo.reference_samples samples pi_ref through an engine of its own over the frozen "
                              "reference copy, which model.lora (the reference is the policy with adapters off) and "
                              "trainer.parallelism=fsdp (a sharded copy) do not have: use full fine-tuning without fsdp, "
                              "or algorithm.qrpo.reference_samples=0 (the group as the reference set)")
        check_rto_run(algorithm.rto, str(config.model.path or "") if config.model.source == "path" else "",
                      config.model.lora is not None, trainer.parallelism)
        check_parallelism(trainer.parallelism, trainer.prompts_per_step, algorithm, rollout.strategy)
        check_sharded_run_features(config)
        check_swarm(config, algorithm)
        validate_spec(cfg.dataset, source=config.data_source, data_dir=config.data_dir)
        check_reward_matches_dataset(config.reward.name, config.dataset)
        check_reward_config(config.reward)
        if config.reward.judge is not None and config.reward.judge.kind == "model":
            validate_model_config(config.reward.judge.model)  # the judge's model, refused before anything loads
        check_replay_pool(rollout, cfg.dataset, config.seed, config.data_dir, config.data_source)
        if rollout.strategy == "difficulty_adaptive":  # DART's pre-collected successes: this run's questions
            check_pool_problems(DifficultyOptions.from_config(rollout).pool, DifficultyOptions.POOL_KEY, cfg.dataset,
                                config.seed, config.data_dir, config.data_source)
        check_success_training(rollout, algorithm.loss.name, POLICY_LOSSES.accepted_inputs(algorithm.loss.name))
        guidance = GuidanceOptions.from_config(config.guidance)
        if rollout.strategy == "references" and guidance.source == "none":
            raise ConfigError(
                "rollout=references (algorithm=otr) trains on guidance references only and guidance=none gives "
                "none; choose guidance=dataset or guidance=jsonl guidance.path=<file>"
            )
    if config.mode == "generate":
        check_generate_output(config)
        validate_spec(cfg.dataset, source=config.data_source, data_dir=config.data_dir)
        check_reward_matches_dataset(config.reward.name, config.dataset)
        if config.warmup is not None:
            check_warmup(config.warmup)
    elif config.warmup is not None:
        raise ConfigError(f"warmup (Thinkless' paired warm-up data) is written by mode=generate, not mode={config.mode}: "
                          "drop the warmup node or set mode=generate")

    ev = config.eval
    ks = list(ev.k)
    if not ks:
        raise ConfigError("eval.k is empty; give at least one k, e.g. eval.k=[1]")
    for k in ks:
        if k < 1 or k > ev.n:
            raise ConfigError(f"eval.k contains {k}, but pass@k needs 1 <= k <= eval.n = {ev.n}; raise eval.n or drop k")
    if not ev.benchmarks:
        raise ConfigError("eval.benchmarks is empty; pick a suite with eval=<name>")
    for spec in cfg.eval.benchmarks.values():
        validate_spec(spec, source=config.data_source, data_dir=config.data_dir)

    check_sandbox(config.sandbox if config.sandbox is not None else SandboxConfig())  # reward values: the schema walk

    validate_model_config(config.model)
    check_fits_here(config, device, training=config.mode == "train" and config.trainer.steps > 0,
                    frozen_models=int(algorithm.needs_reference) + int(algorithm.rto is not None)
                    + int(config.algorithm.step_critic is not None) + int(config.algorithm.preference_model is not None),
                    trained_models=int(algorithm.online_prm is not None))
    return algorithm
