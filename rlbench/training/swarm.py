"""SAPO's swarm: several actors, each with its own policy, sharing rollouts (``trainer.parallelism=swarm``).

Swarm sAmpling Policy Optimization, Gensyn AI Team (Amico et al.) 2025, arXiv:2509.08721, section 3
(Algorithm 1). Every actor is one torchrun process and a complete single-process run of its own:

* its own policy, optimizer, run folder (``<output_dir>/actor<r>``) and seed: actor r runs with
  ``seed + r * RANK_STREAM_STRIDE`` (rlbench.training.distributed.rank_stream_seed), so actor 0 is
  exactly the single-process run of ``seed`` and the others are independent runs of their own seeds;
  no gradient, weight or collective is shared (no torch.distributed process group is joined);
* each step it samples I = ``trainer.prompts_per_step - trainer.swarm.external`` prompts and their
  groups with its own policy and publishes them to the swarm's pool (a key-value store on torchrun's
  rendezvous: decoded text, the token ids, the sampling log-probs, the problem and the actor's policy
  version);
* it trains on its I groups plus J = ``trainer.swarm.external`` groups drawn without replacement from
  what the other actors published for the same step (a seeded draw: a function of the actor's seed and
  the step), graded again by its own grader and reward shaping. I + J = prompts_per_step, so a swarm
  step has the batch of a single run and the advantage's groups stay whole (one per prompt).
  ``trainer.swarm.pool_filter=zero_advantage`` (the paper's controlled runs, sections 3.2 and 5): the
  receiver grades every published group first and draws only from those whose rewards are not all
  equal (a GRPO advantage of 0 otherwise); with fewer than J of them the step trains on those.

Asynchrony (``trainer.swarm.lag`` = d, the paper's nodes publish and sample without waiting, modelled as
a bounded, deterministic lag): actor at step s draws from what the others published at step s - d, and
the actors agree on a stop after step s from the signals published after step s - d
(:class:`LaggedStops`), so no actor waits for another's current step (they run at most d steps apart).
Steps 1..d have nothing published d steps before: the actor samples all prompts_per_step itself (the
batch keeps its size; the first d steps are the single run's). A checkpoint carries the actor's last d
published lists, which a resumed actor puts into the new pool, so a resumed swarm equals the
uninterrupted one. d = 0 is the synchronous swarm.

pi_old of the shared tokens (``trainer.swarm.old_logprobs``). ``receiver`` (the default, the paper's
rule: section 3, the receiver "re-computes" the log-probs of shared rollouts under its own policy and
trains on them as its own): the shared tokens are declared on-policy (``off_policy`` all 0), so the
step takes pi_old from the receiver's own forward pass and the first update's ratio is 1. ``sender``:
they stay off-policy samples of the SENDER, with the sender's sampling log-probs as behaviour
log-probs; the step then takes pi_old from those (rlbench.training.step.behaviour_old_logp), so the
receiver's ratio is pi_receiver / mu_sender, the exact importance weight of a sample it did not draw.
Either way a shared response is labelled ``behaviour = "swarm:actor<a>"`` and keeps the sender's
policy version (the step's ``max_staleness`` shows its age).

Heterogeneous swarms (``trainer.swarm.models``, one model per actor: :func:`actor_model`; the paper's
open demo mixes Qwen2.5 0.5B and Qwen3 0.6B nodes, section 6). A sender publishes its tokenizer's
fingerprint (rlbench.utils.tokenizer_fingerprint) and EOS id with its groups. A receiver with the same
tokenizer trains on the sent ids; one with another tokenizer trains on its own tokenisation of the
decoded text (EOS appended where the sender ended at its EOS), on-policy, pi_old from its own forward
pass (the receiver rule; the sampling log-probs of those tokens are unknown, NaN). Either way the
receiver re-tokenises the text and counts the responses whose tokens differ from the sent ids
(``swarm_retokenise_mismatch``). A mixed swarm refuses ``old_logprobs=sender`` and
``algorithm.sampling_correction`` (both need the sampling log-probs of the trained tokens).

Checkpoints and resume: each actor checkpoints its own run folder (a single-process run's files; the
manifest records the swarm's N and J, :func:`swarm_manifest`). With J > 0 what must be consistent is
the exchange: the actors agree through the pool (:meth:`SwarmPool.max_over_ranks`, like ddp / fsdp
ranks through an all-reduce) on a stop signal after every step, so they checkpoint after the same step,
and a resumed swarm continues from the newest step every actor has a valid checkpoint of
(:func:`agreed_resume_step`); the shared groups are then the uninterrupted run's, since each actor's
samples and its draw (a function of its seed and the step) continue exactly. A resume with another N
or J is refused (:func:`check_resume_swarm`). Prompt samplers and stages work per actor: an actor's
sampler reads the statistics of its own prompts only (:func:`own_groups`); every actor enters a stage
at the same step (one config).
"""

from __future__ import annotations

import dataclasses
import math
import pickle
from dataclasses import dataclass, field
from functools import cached_property
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from rlbench.algorithm import Algorithm
from rlbench.config.origin import option_file
from rlbench.config.schema import RunConfig, TrainerConfig
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.training.checkpoint import CheckpointError, actor_folder, checkpoint_dirs, read_checkpoint
from rlbench.rollout.engines.base import Completion
from rlbench.rollout.groups import GradedGroups, GroupSampler
from rlbench.rollout.strategies.dynamic_sampling import informative_groups
from rlbench.rollout.strategy import RolloutStrategy
from rlbench.training.distributed import launched_world_size, rank_stream_seed
from rlbench.training.stages import parse_stages, stage_settings
from rlbench.training.step import StepContext
from rlbench.utils import STREAM_SWARM, tokenizer_fingerprint

SWARM_BEHAVIOUR = "swarm"  # behaviour label prefix of a shared response: "swarm:actor<a>"
STORE_PREFIX = "rlbench_swarm/"
STORE_TIMEOUT = timedelta(hours=2)  # how long an actor waits for the others' rollouts of a step


def external_groups(trainer: TrainerConfig) -> int:
    """J: ``trainer.swarm.external`` (0 without the block)."""
    return trainer.swarm.external if trainer.swarm is not None else 0


def check_swarm(config: RunConfig, algorithm: Algorithm, actors: int | None = None) -> None:
    """Bad swarm settings, refused before anything loads: shared groups outside a swarm or with one
    actor, I + J not the step's prompts (at least one local prompt), more shared groups than the
    other actors publish, a rollout strategy other than iid, and pieces that need on-policy data."""
    trainer = config.trainer
    strategy = trainer.parallelism
    J = external_groups(trainer)
    models, lag = (list(trainer.swarm.models), trainer.swarm.lag) if trainer.swarm is not None else ([], 0)
    if strategy != "swarm":
        pool_filter = trainer.swarm.pool_filter if trainer.swarm is not None and trainer.swarm.pool_filter != "none" else None
        for key, value, off in (("external", J, "0"), ("models", models, "[]"), ("lag", lag, "0"),
                                ("pool_filter", pool_filter, "none")):
            if value:
                raise ConfigError(f"trainer.swarm.{key}={value} is a setting of a swarm's actors; "
                                  f"set trainer.parallelism=swarm (under torchrun) or trainer.swarm.{key}={off}")
        return
    N = launched_world_size() if actors is None else actors
    if J and N == 1:
        raise ConfigError(f"trainer.swarm.external={J} takes groups from other actors, but the swarm has one actor; "
                          "start several with torchrun --nproc_per_node N, or set trainer.swarm.external=0")
    stages = parse_stages(trainer.stages, trainer.steps)
    for stage, settings in [(None, {"trainer.prompts_per_step": trainer.prompts_per_step}),
                            *zip(stages, stage_settings(config, stages))]:
        where = "" if stage is None else f"from trainer.stages {stage.label}: "
        prompts = int(settings["trainer.prompts_per_step"])
        I = prompts - J
        if I < 1:
            raise ConfigError(f"{where}trainer.swarm.external={J} leaves no local prompt: a step trains on "
                              f"I = trainer.prompts_per_step - J = {prompts} - {J} = {I} own groups plus J shared ones; "
                              "use J < trainer.prompts_per_step")
        if J > (N - 1) * I:
            raise ConfigError(f"{where}trainer.swarm.external={J}: the other {N - 1} actor(s) publish (N-1) * I = "
                              f"{(N - 1) * I} groups per step (I = trainer.prompts_per_step - J = {I}); use J <= {(N - 1) * I}")
    rollout = config.rollout.strategy
    if rollout != "iid":
        raise ConfigError(f"trainer.parallelism=swarm shares the groups of rollout=iid only (got rollout={rollout})")
    if J and algorithm.on_policy_requirements:
        raise ConfigError(f"trainer.swarm.external={J} trains on other actors' samples, but algorithm "
                          f"'{algorithm.name}' needs on-policy data: " + "; ".join(algorithm.on_policy_requirements)
                          + ". Use trainer.swarm.external=0")
    if lag and not J:
        raise ConfigError(f"trainer.swarm.lag={lag} delays the groups the actors share, but they share none "
                          "(trainer.swarm.external=0); set trainer.swarm.external=J > 0 or trainer.swarm.lag=0")
    if trainer.swarm.pool_filter != "none" and not J:
        raise ConfigError(f"trainer.swarm.pool_filter={trainer.swarm.pool_filter} filters the groups the actors share, but "
                          "they share none (trainer.swarm.external=0); set trainer.swarm.external=J > 0 or pool_filter=none")
    if models:
        if len(models) != N:
            raise ConfigError(f"trainer.swarm.models lists {len(models)} models, one per actor, but the swarm has {N} "
                              f"actors; list {N} (null: the run's model) or start torchrun --nproc_per_node {len(models)}")
        run_model = dataclasses.asdict(config.model)
        listed = [actor_model(run_model, entry) for entry in models]
        if J and any(model != listed[0] for model in listed):  # a mixed swarm
            if trainer.swarm.old_logprobs == "sender":
                raise ConfigError("trainer.swarm.old_logprobs=sender takes pi_old from the sender's sampling log-probs, "
                                  "but trainer.swarm.models mixes models: another tokenizer's tokens have no log-prob "
                                  "under the receiver's; use trainer.swarm.old_logprobs=receiver (the paper's rule)")
            if getattr(algorithm, "sampling_correction", None) is not None:
                raise ConfigError("algorithm.sampling_correction weighs tokens by pi_old / pi_sampler, but trainer.swarm."
                                  "models mixes models: a response re-tokenised by its receiver has no sampling "
                                  "log-prob; set algorithm.sampling_correction=null or one model for every actor")


def actor_model(run_model: dict[str, Any], entry: Any) -> dict[str, Any]:
    """The model node of an actor listed as ``entry`` in ``trainer.swarm.models``: null (the run's model), a
    conf/model option name, a checkpoint folder (model=checkpoint with that path), or a mapping of model fields
    merged over the run's model. The run's ``lora`` setting is kept (a training setting, not the model's).
    ConfigError for a name that is neither an option nor a folder: checked before anything loads."""
    entry = OmegaConf.to_container(entry, resolve=True) if OmegaConf.is_config(entry) else entry
    if entry is None:
        return run_model
    if isinstance(entry, dict):
        return OmegaConf.to_container(OmegaConf.merge(run_model, entry), resolve=True)
    name = str(entry)
    option = option_file("model", name)
    if "/" not in name and option.is_file():
        model = OmegaConf.to_container(OmegaConf.load(option), resolve=True)
    elif Path(name).is_dir():
        model = {**OmegaConf.to_container(OmegaConf.load(option_file("model", "checkpoint")), resolve=True), "path": name}
    else:
        raise ConfigError(f"trainer.swarm.models: {name!r} is neither a model option (conf/model/<name>.yaml) nor a "
                          "checkpoint folder; use an option name (rlbench list model), a folder, a mapping of model "
                          "fields, or null")
    return {**model, **({"lora": run_model["lora"]} if "lora" in run_model else {})}


def actor_config(cfg: DictConfig, actor: int) -> DictConfig:
    """The configuration of actor ``actor``: its own seed (rank_stream_seed; actor 0 keeps ``seed``),
    run folder ``<output_dir>/actor<r>`` and, with ``trainer.swarm.models``, its own model
    (:func:`actor_model`); everything else is the swarm's."""
    own = cfg.copy()
    models = cfg.trainer.get("swarm", {}).get("models") or []
    with open_dict(own):
        own.seed = rank_stream_seed(int(cfg.seed), actor)
        if models:
            own.model = actor_model(OmegaConf.to_container(cfg.model, resolve=True), models[actor])
        own.output_dir = str(actor_folder(cfg.output_dir, actor))
        if cfg.get("resume"):  # resume=<the swarm's folder>: each actor continues its own folder
            own.resume = str(actor_folder(cfg.resume, actor))
    return own


# ------------------------------------------------------------------------------ checkpoints and resume


def swarm_manifest(actors: int, external: int) -> dict[str, Any]:
    """What an actor's checkpoint manifest records of the swarm."""
    return {"swarm": {"actors": int(actors), "external": int(external)}}


def check_resume_swarm(manifest: dict[str, Any], path: Path, actors: int, external: int) -> None:
    """A swarm resumes with the N actors and the J shared groups that wrote its checkpoints (each
    actor's stream and the exchange depend on both); ``resume_allow`` cannot change them."""
    written = manifest.get("swarm")
    if written is None:
        raise ConfigError(f"resume: checkpoint {path} was not written by a swarm actor (trainer.parallelism=swarm); "
                          f"resume it with the strategy that wrote it ({manifest.get('parallelism', manifest.get('strategy', 'single'))})")
    if (int(written["actors"]), int(written["external"])) != (actors, external):
        raise ConfigError(
            f"resume: checkpoint {path} was written by a swarm of {written['actors']} actors sharing "
            f"trainer.swarm.external={written['external']} groups, but this run has {actors} actors and "
            f"trainer.swarm.external={external}; resume with torchrun --nproc_per_node {written['actors']} "
            f"and trainer.swarm.external={written['external']}")


def valid_checkpoint_steps(run_folder: str | Path) -> list[int]:
    """The steps of the run's valid checkpoints (read_checkpoint: manifest and file sizes), oldest first."""
    steps = []
    for path in checkpoint_dirs(run_folder):
        try:
            steps.append(read_checkpoint(path).step)
        except CheckpointError:
            continue
    return steps


def agreed_resume_step(steps_by_actor: Sequence[Sequence[int]]) -> int:
    """The step a swarm resumes from: the newest step of which every actor has a valid checkpoint (an
    actor killed while writing its checkpoint of step s leaves the swarm at the previous common step).
    ConfigError when the actors have no step in common."""
    common = set(steps_by_actor[0]).intersection(*map(set, steps_by_actor[1:]))
    if not common:
        listing = "; ".join(f"actor {a}: {list(steps) or 'none'}" for a, steps in enumerate(steps_by_actor))
        raise ConfigError(f"resume: the swarm's actors have no checkpoint at a common step ({listing}); every actor "
                          "must continue from the same step for the shared groups to be the uninterrupted run's: "
                          "start the run again (or keep more checkpoints: trainer.keep_checkpoints)")
    return max(common)


class KeyValueStore(Protocol):
    """What the pool needs of a store (torch.distributed.Store: TCPStore, PrefixStore, HashStore)."""

    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str) -> bytes: ...

    def delete_key(self, key: str) -> bool: ...


class SwarmPool:
    """The shared pool: actor ``actor`` of ``actors`` publishes its groups of step ``step`` and reads
    every other actor's of step ``step - lag`` (blocking until they are there). The store keeps 2 + 2 lag
    steps per actor: an actor publishing step s has read the others' step s - 1 - lag, which each of them
    published after reading everyone's step s - 2 - 2 lag, so it deletes its own step s - 2 - 2 lag.

    The actors' agreements (a stop signal after a step, the resume step) go through the same store
    as rounds every actor takes in the same order (:meth:`gather`, :meth:`max_over_ranks`,
    :meth:`barrier`: the calls of rlbench.training.distributed.World that the training loop and the
    runner make, without a process group)."""

    def __init__(self, store: KeyValueStore, actor: int, actors: int):
        self.store, self.actor, self.actors = store, actor, actors
        self.rounds = 0  # agreement rounds taken

    @property
    def size(self) -> int:
        return self.actors

    def gather(self, values: list[Any]) -> list[Any]:
        """Every actor's ``values`` concatenated in actor order (on every actor)."""
        self.rounds += 1
        self.store.set(f"round{self.rounds}/actor{self.actor}", pickle.dumps(list(values)))
        if self.rounds > 2:  # every actor has read this actor's round - 2 before publishing round - 1
            self.store.delete_key(f"round{self.rounds - 2}/actor{self.actor}")
        return [v for a in range(self.actors) for v in pickle.loads(self.store.get(f"round{self.rounds}/actor{a}"))]

    def max_over_ranks(self, value: int) -> int:
        """The largest of the actors' ``value``: a stop signal that reached one actor stops them all."""
        return max(int(v) for v in self.gather([int(value)]))

    def barrier(self) -> None:
        """Returns when every actor has called it."""
        self.gather([])

    def exchange(self, step: int, shared: list[dict[str, Any]], lag: int = 0) -> list[list[dict[str, Any]]] | None:
        """Publish ``shared``; the other actors' lists for ``step - lag``, in actor order (None before step 1)."""
        self.publish(step, shared)
        if step - 2 - 2 * lag >= 1:
            self.store.delete_key(self.key(step - 2 - 2 * lag, self.actor))
        if step - lag < 1:
            return None
        return [pickle.loads(self.store.get(self.key(step - lag, a))) for a in range(self.actors) if a != self.actor]

    def publish(self, step: int, shared: list[dict[str, Any]]) -> None:
        self.store.set(self.key(step, self.actor), pickle.dumps(shared))

    @staticmethod
    def key(step: int, actor: int) -> str:
        return f"step{step}/actor{actor}"


@dataclass
class LaggedStops:
    """The step-boundary stop agreement of a swarm with lag d (``trainer.swarm.lag``): after step s every
    actor publishes its stop signal and they all stop when a signal of step s - d was set (none before
    step ``start`` + d + 1, ``start`` the step resumed from), so no actor waits for the others' step s, and
    all stop after the same step, d steps after the signal, with a checkpoint of that step. The loop's
    ``raise_if_requested`` calls :meth:`max_over_ranks` once per step (rlbench.training.interrupt)."""

    pool: SwarmPool
    lag: int
    step: int = 0  # rounds taken: the last step agreed on
    start: int = 0  # the step resumed from: earlier rounds were the interrupted run's

    @property
    def size(self) -> int:
        return self.pool.actors

    def resume_at(self, step: int) -> None:
        self.step = self.start = int(step)

    def max_over_ranks(self, value: int) -> int:
        """The largest stop signal the actors published after step s - d (0 for a step before start + d + 1)."""
        self.step += 1
        store, actor = self.pool.store, self.pool.actor
        store.set(self.key(self.step, actor), pickle.dumps(int(value)))
        if self.step - 2 - 2 * self.lag > self.start:
            store.delete_key(self.key(self.step - 2 - 2 * self.lag, actor))
        if self.step - self.lag <= self.start:
            return 0
        return max(int(pickle.loads(store.get(self.key(self.step - self.lag, a)))) for a in range(self.pool.actors))

    @staticmethod
    def key(step: int, actor: int) -> str:
        return f"stop{step}/actor{actor}"


def join_swarm() -> SwarmPool:
    """The pool of this torchrun process (the key-value store of torchrun's rendezvous; no process group)."""
    import torch.distributed as dist

    store, rank, size = next(dist.rendezvous("env://", timeout=STORE_TIMEOUT))
    return SwarmPool(dist.PrefixStore(STORE_PREFIX, store), int(rank), int(size))


def shared_groups(graded: GradedGroups, actor: int, version: int, tokenizer: str | None = None,
                  eos: int | None = None) -> list[dict[str, Any]]:
    """What an actor publishes of its graded groups: per group the problem and per response the decoded
    text, token ids, sampling log-probs and whether it ended with EOS, with the actor, its policy
    version, its tokenizer's fingerprint (rlbench.utils.tokenizer_fingerprint) and EOS id. Rewards are
    not sent: the receiver grades with its own grader."""
    return [
        {
            "problem": problem, "actor": actor, "version": version, "tokenizer": tokenizer, "eos": eos,
            "responses": [{"text": c.text, "ids": list(c.response_ids), "logprobs": list(c.logprobs),
                           "finished": bool(c.finished)} for c in group],
        }
        for problem, group in zip(graded.problems, graded.groups)
    ]


def draw_external(pool: Sequence[dict[str, Any]], count: int, seed: int, step: int) -> list[dict[str, Any]]:
    """``count`` groups of ``pool`` without replacement: a function of (seed, step) alone."""
    rng = np.random.default_rng([seed, STREAM_SWARM, step])
    return [pool[i] for i in rng.choice(len(pool), size=count, replace=False).tolist()]


def retokenised(tokenizer: Any, response: dict[str, Any], sender_eos: int | None = None) -> list[int]:
    """The receiver's tokens of a shared response: its decoded text, plus the receiver's EOS when it ended
    at the sender's (``sender_eos``; None: the receiver's id) (the text is decoded without special tokens)."""
    ids = list(tokenizer(response["text"], add_special_tokens=False)["input_ids"])
    eos = tokenizer.eos_token_id
    if response["finished"] and response["ids"] and response["ids"][-1] == (eos if sender_eos is None else sender_eos):
        ids.append(eos)
    return ids


def external_completion(shared: dict[str, Any], response: dict[str, Any], prompt_ids: tuple[int, ...],
                        old_logprobs: str = "receiver", own_ids: list[int] | None = None) -> Completion:
    """A shared response as the receiver's completion, labelled with the sender and its policy version.
    ``old_logprobs="receiver"``: on-policy in every token (pi_old = the receiver's forward pass);
    ``"sender"``: off-policy in every token, pi_old = the sender's sampling log-probs. ``own_ids``: the
    receiver's re-tokenisation of the text, trained on in place of the sender's ids when the sender's
    tokenizer is another (a mixed swarm; receiver rule only): their sampling log-probs are unknown (NaN)."""
    ids = list(response["ids"]) if own_ids is None else list(own_ids)
    logprobs = list(response["logprobs"]) if own_ids is None else [math.nan] * len(ids)
    sender = old_logprobs == "sender"
    if sender and own_ids is not None:
        raise ValueError("a re-tokenised response has no sender log-probs: trainer.swarm.old_logprobs=receiver only")
    return Completion(
        request_index=0, prompt_ids=prompt_ids, response_ids=ids, logprobs=logprobs,
        finished=bool(response["finished"]), text=response["text"],
        behaviour=f"{SWARM_BEHAVIOUR}:actor{shared['actor']}", off_policy=[int(sender)] * len(ids),
        behaviour_logprobs=list(response["logprobs"]) if sender else None, policy_version=int(shared["version"]),
    )


@dataclass
class SwarmRollout(RolloutStrategy):
    """The step's rollout of one actor: its strategy's groups for the first I prompts, published, plus
    J groups drawn from the other actors' (``J = 0``: the strategy's groups alone, nothing exchanged,
    so the actor is a single-process run). Every other hook is the inner strategy's."""

    inner: Any  # the run's rollout strategy (iid)
    pool: SwarmPool | None  # None when J = 0
    external: int  # J
    sampler: GroupSampler
    seed: int  # the actor's seed
    policy_version: Callable[[], int]
    old_logprobs: str = "receiver"  # trainer.swarm.old_logprobs: pi_old of the shared tokens
    lag: int = 0  # trainer.swarm.lag: step s draws from what the others published at step s - lag
    pool_filter: str = "none"  # trainer.swarm.pool_filter: zero_advantage drops the groups with all rewards equal
    step: int = 0  # rollouts done (the pool's round)
    published: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # lag > 0: the last lag steps' lists
    unpublished: bool = False  # restored from a checkpoint: ``published`` is not in the (new) store yet

    @cached_property
    def fingerprint(self) -> str | None:
        """This actor's tokenizer (rlbench.utils.tokenizer_fingerprint), sent with its groups."""
        return tokenizer_fingerprint(self.sampler.tokenizer)

    @property
    def setup(self) -> Any:
        """The inner strategy's RolloutSetup (group size, sampling settings), which a stage changes."""
        return self.inner.setup

    @setup.setter
    def setup(self, value: Any) -> None:
        self.inner.setup = value

    def rollout(self, problems: list[Problem], draw_prompts: Callable[[int], list[Problem]] | None) -> tuple[GradedGroups, dict[str, float]]:
        # steps 1..lag: nothing was published lag steps before, so the actor samples every prompt itself
        warming_up = self.step + 1 <= self.lag
        local_count = len(problems) - (0 if warming_up else self.external)
        local, metrics = self.inner.rollout(problems[:local_count], draw_prompts)
        self.step += 1
        if not self.external:
            return local, metrics
        version = self.policy_version()
        for group in local.groups:
            for completion in group:
                completion.policy_version = version
        shared = shared_groups(local, self.pool.actor, version, self.fingerprint, self.sampler.tokenizer.eos_token_id)
        if self.lag:
            self.keep_published(shared)
        others = self.pool.exchange(self.step, shared, self.lag)
        if others is None:
            return local, metrics
        pool = [g for published in others for g in published]
        filtered = {}
        if self.pool_filter == "zero_advantage":  # arXiv:2509.08721, sections 3.2 and 5: graded, then filtered, then drawn
            candidates, mismatches = self.receive(pool)
            kept = informative_groups(candidates.rewards, candidates.group_index).nonzero().flatten().tolist()
            chosen = draw_external(kept, min(self.external, len(kept)), self.seed, self.step)
            external, mismatch = candidates.select(chosen), sum(mismatches[g] for g in chosen)
            filtered = {"swarm_pool_informative_groups": float(len(kept)), "swarm_external_groups": float(len(chosen))}
        else:
            external, mismatches = self.receive(draw_external(pool, self.external, self.seed, self.step))
            mismatch = sum(mismatches)
        graded = GradedGroups.concat([local.with_group_ids(0), external.with_group_ids(len(local.groups))])
        return graded, {
            **metrics, **filtered,
            "swarm_local_reward_mean": float(local.outcome.mean()),
            "swarm_external_reward_mean": float(external.outcome.mean()),
            "swarm_retokenise_mismatch": float(mismatch),
        }

    def keep_published(self, shared: list[dict[str, Any]]) -> None:
        """Keep this step's list and the lag - 1 before it (a checkpoint carries them, so that a resumed swarm
        reads the same lagged groups); after a restore, put the kept ones into the new store first."""
        if self.unpublished:
            for step, kept in self.published.items():
                self.pool.publish(step, kept)
            self.unpublished = False
        self.published[self.step] = shared
        self.published = {step: kept for step, kept in self.published.items() if step > self.step - self.lag}

    def receive(self, chosen: list[dict[str, Any]]) -> tuple[GradedGroups, list[int]]:
        """The chosen shared groups graded by this actor, and per group how many responses re-tokenise differently.
        From a sender with another tokenizer (a mixed swarm) the receiver trains on its own tokens of the text."""
        problems = [shared["problem"] for shared in chosen]
        prompt_ids = self.sampler.encode(problems)
        tokenizer = self.sampler.tokenizer
        groups, mismatches = [], []
        for shared, ids in zip(chosen, prompt_ids):
            foreign = shared.get("tokenizer", self.fingerprint) != self.fingerprint
            group, mismatch = [], 0
            for response in shared["responses"]:
                own = retokenised(tokenizer, response, shared.get("eos"))
                mismatch += own != response["ids"]
                group.append(external_completion(shared, response, ids, self.old_logprobs, own if foreign else None))
            groups.append(group)
            mismatches.append(mismatch)
        return self.sampler.grade(problems, groups, self.setup.params.max_new_tokens), mismatches

    def state_dict(self) -> dict[str, Any]:
        state = {"step": self.step, "inner": self.inner.state_dict()}
        if self.lag:  # the problems as plain fields: a checkpoint holds no objects (torch.load(weights_only=True))
            state["published"] = [[step, [{**g, "problem": dataclasses.asdict(g["problem"])} for g in kept]]
                                  for step, kept in self.published.items()]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        if state["inner"] is not None:
            self.inner.load_state_dict(state["inner"])
        if self.lag:
            self.published = {int(step): [{**g, "problem": Problem(**g["problem"])} for g in kept]
                              for step, kept in state.get("published", [])}
            self.unpublished = True

    def training_logits_transform(self) -> Callable[[torch.Tensor, Any], torch.Tensor] | None:
        return self.inner.training_logits_transform()

    def stop_replay(self) -> None:
        self.inner.stop_replay()

    def in_context(self, problem: Problem) -> Problem:
        return self.inner.in_context(problem)

    def training_problems(self, problems: list[Problem]) -> list[Problem]:
        return self.inner.training_problems(problems)


def swarm_rollout(ctx: StepContext, config: RunConfig, pool: SwarmPool | None) -> SwarmRollout:
    """Wrap the step context's strategy (``ctx.strategy``) into the actor's swarm rollout."""
    return SwarmRollout(ctx.strategy, pool, external_groups(config.trainer), ctx.sampler, config.seed,
                        lambda: ctx.policy_version, config.trainer.swarm.old_logprobs, config.trainer.swarm.lag,
                        config.trainer.swarm.pool_filter)


def own_groups(graded: GradedGroups) -> GradedGroups:
    """The groups an actor sampled itself: ``graded`` without the groups received from other actors
    (labelled ``swarm:actor<a>``). A prompt sampler's statistics count these only: a shared group
    answers another actor's problem (its own data order, and under the same uid another problem when
    the dataset is generated from the seed, e.g. arith) with another policy's responses."""
    shared = [g for g, group in enumerate(graded.groups)
              if group and all(c.behaviour.startswith(SWARM_BEHAVIOUR + ":") for c in group)]
    if not shared:
        return graded
    return graded.select([g for g in range(len(graded.groups)) if g not in shared])
