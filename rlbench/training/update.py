"""One update of the policy on a batch: the micro-batch objective, the metrics of an update, and the
standard schedule (``epochs`` passes over ``minibatches`` optimizer batches, gradients accumulated
over micro-batches). The other schedules (sfpo, trpo) are in rlbench.training.update_schedules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rlbench.algorithm import Algorithm
from rlbench.algorithm.step_inputs import STEP_INPUTS
from rlbench.training.batch import TrainBatch, batch_norms, group_minibatches, micro_batches, whole_group_chunks
from rlbench.training.critic_model import SeparateCritic
from rlbench.training.distributed import backward, gradient_norm, reshard
from rlbench.training.forward import TokenOutputs, token_outputs, value_model_outputs
from rlbench.utils import loss_generator

ADDITIVE_METRICS = {"policy_loss", "kl", "value_loss", "positive_nll"}
# the loss step's inputs a TrainBatch field holds: the batch's own, and the grader's verdicts it keeps (correct)
BATCH_LOSS_INPUTS = STEP_INPUTS.names("loss", "objective", producer="batch") | STEP_INPUTS.names("loss", "objective", producer="graded")


@dataclass
class LossStreams:
    """The ``generator`` step input of one step's update (rlbench/algorithm/step_inputs.py): the k-th
    micro-batch loss of the update (counted over its epochs, mini-batches and passes) draws from
    ``loss_generator(seed, step, k, rank)`` (rlbench.utils), ``step`` being the policy updates before
    this one. Derived, never advanced across steps: nothing of it is checkpointed."""

    seed: int
    step: int
    rank: int = 0
    calls: int = 0

    def at(self, index: int) -> torch.Generator:
        """The generator of micro-batch ``index`` (the same one each time it is asked for)."""
        return loss_generator(self.seed, self.step, index, self.rank)

    def next(self) -> torch.Generator:
        """The next micro-batch's generator."""
        self.calls += 1
        return self.at(self.calls - 1)


def micro_batch_loss(
    model: torch.nn.Module,
    sub: TrainBatch,
    algorithm: Algorithm,
    norms: dict[str, int],
    temperature: float,
    *,
    track_entropy: bool = True,
    progress: float = 0.0,
    value_head: torch.nn.Module | None = None,
    proximal_model: torch.nn.Module | None = None,
    with_log_probs: bool = False,
    generator: torch.Generator | None = None,
    value_model: torch.nn.Module | None = None,
) -> tuple[torch.Tensor, dict[str, float], TokenOutputs]:
    """The objective of one micro-batch (with gradient), its metrics and the forward's outputs. The
    objective reads the loss step's inputs (rlbench/algorithm/step_inputs.py, readers loss and objective).

    Without stored old log-probs (one on-policy update) pi_old is the detached current policy
    (ratio 1); likewise V_old for the value clip. ``proximal_model`` (decoupled PPO) supplies
    ``prox_logp`` from its own no-grad forward; ``generator`` is the loss's random stream (LossStreams). The
    values come from ``value_head`` on the policy's hidden states, or from a separate critic ``value_model``
    (rlbench.training.critic_model; its own forward, with gradient into its own weights only)."""
    if sub.old_logp is None and sub.has_off_policy:
        raise ValueError("off-policy tokens need stored old log-probs (training.step.behaviour_old_logp), not ratio 1")
    out = token_outputs(
        model, sub, temperature, with_entropy=track_entropy or algorithm.uses_entropy_bonus,
        entropy_requires_grad=algorithm.uses_entropy_bonus, value_head=value_head,
        with_log_probs=with_log_probs or algorithm.needs_vocabulary_log_probs,
    )
    prox_logp = None
    if proximal_model is not None:
        with torch.no_grad():
            prox_logp = token_outputs(proximal_model, sub, temperature).logp
    if value_model is not None:
        out.values = value_model_outputs(value_model, sub)
    loss, metrics = algorithm.compute_loss(
        norms=norms,
        # the loss step's inputs the batch holds (advantages, mask, ref_logp, token_weights, ...); then the forward's
        **{name: getattr(sub, name) for name in BATCH_LOSS_INPUTS},
        **{name: sub.extras.get(name) for name in STEP_INPUTS.names("loss", producer="strategy")},  # e.g. sft_target
        logp=out.logp,
        old_logp=sub.old_logp if sub.old_logp is not None else out.logp.detach(),
        entropy=out.entropy,
        values=out.values,
        old_values=sub.old_values if sub.old_values is not None or out.values is None else out.values.detach(),
        log_probs=out.log_probs if algorithm.needs_vocabulary_log_probs else None,
        prox_logp=prox_logp,
        progress=progress,
        generator=generator,
    )
    if out.entropy is not None:
        tokens = float(sub.response_mask.sum().item())
        metrics["entropy"] = float((out.entropy * sub.response_mask).sum().item() / max(tokens, 1.0))
    return loss, metrics, out


class UpdateMetrics:
    """Averages micro-batch metrics over an update: token means weighted by the micro-batch's
    tokens; losses already normalised by their optimizer batch (ADDITIVE_METRICS) summed per
    optimizer step and averaged over the steps.

    A token mean over an update without a single trainable token (e.g. every response masked by
    DAPO's overlong filter) is a statistic of the empty set: NaN, never 0."""

    def __init__(self) -> None:
        self.weighted: dict[str, float] = {}
        self.additive: dict[str, float] = {}
        self.tokens = 0.0

    def add(self, metrics: dict[str, float], tokens: float) -> None:
        for key, value in metrics.items():
            if key in ADDITIVE_METRICS:
                self.additive[key] = self.additive.get(key, 0.0) + value
            else:
                self.weighted[key] = self.weighted.get(key, 0.0) + value * tokens
        self.tokens += tokens

    def result(self, optimizer_steps: int) -> dict[str, float]:
        tokens = self.tokens if self.tokens > 0 else math.nan
        out = {key: value / tokens for key, value in self.weighted.items()}
        out.update({key: value / max(optimizer_steps, 1) for key, value in self.additive.items()})
        return out


def standard_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: TrainBatch,
    algorithm: Algorithm,
    *,
    micro_batch_size: int,
    max_grad_norm: float | None,
    temperature: float,
    norm_length: int,
    generator: torch.Generator | None = None,
    track_entropy: bool = True,
    progress: float = 0.0,
    value_head: torch.nn.Module | None = None,
    proximal: object | None = None,
    loss_streams: LossStreams | None = None,
    critic: SeparateCritic | None = None,
) -> dict[str, float]:
    """One batch's worth of optimizer steps: ``epochs`` passes over ``minibatches`` splits.

    Each mini-batch is processed in micro-batches whose gradients accumulate; aggregation uses
    the mini-batch's token and sequence counts, so the accumulated gradient equals the gradient
    of the mini-batch loss computed in one pass. When the batch is used for exactly one on-policy
    update the old log-probs are the detached current ones (ratio 1), and no extra pass is run.
    ``value_head`` (PPO's critic) is trained by the same steps; ``proximal`` (decoupled PPO: has
    ``.model`` and ``.update(model)``) gives prox_logp and follows the weights after every step. A separate
    ``critic`` (rlbench.training.critic_model) values the same micro-batches and takes its own optimizer step
    after the policy's, on each mini-batch (metric critic_grad_norm).
    ``generator`` orders the mini-batches; ``loss_streams`` gives each micro-batch loss its own random
    stream (none without it).
    """
    model.train()
    reshard(model)
    device = batch.input_ids.device
    parameters = [*model.parameters(), *(value_head.parameters() if value_head is not None else ())]
    metrics_total = UpdateMetrics()
    grad_norms: list[float] = []
    critic_norms: list[float] = []
    if critic is not None:
        critic.model.train()
    whole_groups = algorithm.loss_reads_whole_groups  # a pairwise loss: no group is split (registry.Needs)
    for _ in range(algorithm.epochs):
        if whole_groups:
            splits = group_minibatches(batch.group_index, algorithm.minibatches, generator if algorithm.minibatches > 1 else None)
        else:
            order = (
                torch.randperm(batch.size, generator=generator).to(device)
                if algorithm.minibatches > 1
                else torch.arange(batch.size, device=device)
            )
            splits = order.chunk(algorithm.minibatches)
        for minibatch in splits:
            norms = batch_norms(batch, minibatch, norm_length)
            parts = (whole_group_chunks(minibatch, batch.group_index, micro_batch_size) if whole_groups
                     else micro_batches(minibatch, micro_batch_size))
            for rows in parts:
                sub = batch.select(rows)
                loss, metrics, _ = micro_batch_loss(
                    model, sub, algorithm, norms, temperature, track_entropy=track_entropy, progress=progress,
                    value_head=value_head, proximal_model=proximal.model if proximal is not None else None,
                    generator=loss_streams.next() if loss_streams is not None else None,
                    value_model=critic.model if critic is not None else None,
                )
                backward(loss)
                metrics_total.add(metrics, float(sub.response_mask.sum().item()))
            clip = max_grad_norm if max_grad_norm is not None and max_grad_norm > 0 else math.inf
            grad_norms.append(gradient_norm(torch.nn.utils.clip_grad_norm_(parameters, clip)))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if critic is not None:
                critic_norms.append(critic.step(max_grad_norm))
            if proximal is not None:
                proximal.update(model)
    result = metrics_total.result(len(grad_norms))
    result["grad_norm"] = sum(grad_norms) / len(grad_norms)
    result["optimizer_steps"] = float(len(grad_norms))
    if critic_norms:
        result["critic_grad_norm"] = sum(critic_norms) / len(critic_norms)
    return result
