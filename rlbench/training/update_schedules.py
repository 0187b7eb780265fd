"""The update schedules' driver: standard (rlbench.training.update.standard_update; with a critic
or decoupled PPO's EWMA proximal policy), sfpo and trpo, plus the state an update keeps between
training steps (value head or separate critic, EWMA proximal policy, SFPO's switch).

    state = make_update_state(algorithm, model, trainer)  # once per run
    optimizer over state.parameters(model)                # the policy and, with a shared critic, the value head;
                                                          # a separate critic has its own (state.critic)
    stats = apply_update_schedule(model, optimizer, batch, algorithm, state, ...)   # every step

The settings and the pure math (conjugate gradient, reposition, EWMA, entropy switch) live in
rlbench.algorithm.schedules.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from rlbench.algorithm import Algorithm
from rlbench.algorithm.critic import ValueHead, make_value_head
from rlbench.algorithm.schedules import (
    SFPOSettings,
    SFPOSwitch,
    TRPOSettings,
    conjugate_gradient,
    ewma_update_,
    interpolate_,
    trust_region_scale,
)
from rlbench.training.batch import TrainBatch, batch_norms, micro_batches
from rlbench.training.critic_model import SeparateCritic
from rlbench.training.forward import token_outputs
from rlbench.training.update import LossStreams, UpdateMetrics, micro_batch_loss, standard_update


class EWMAPolicy:
    """The proximal policy of decoupled PPO: a frozen copy of the policy whose weights are the
    debiased EWMA of the policy's weights after each optimizer step (``ewma_update_``; Hilton, Cobbe &
    Schulman 2021, arXiv:2110.00641). It costs one more copy of the model and one no-grad forward per
    micro-batch."""

    def __init__(self, model: torch.nn.Module, decay: float):
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self.decay = decay
        self.total_weight = 1.0  # W_0: the copy is theta_0

    def update(self, model: torch.nn.Module) -> None:
        self.total_weight = ewma_update_(
            self.model.parameters(), [p.detach() for p in model.parameters()], self.total_weight, self.decay
        )

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "total_weight": self.total_weight}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.total_weight = float(state["total_weight"])


@dataclass
class UpdateState:
    """What the update keeps across training steps; each part exists only when the algorithm uses it."""

    value_head: ValueHead | None = None  # algorithm.critic.model=shared
    proximal: EWMAPolicy | None = None
    sfpo_switch: SFPOSwitch | None = None
    critic: SeparateCritic | None = None  # algorithm.critic.model=separate

    @property
    def has_critic(self) -> bool:
        return self.value_head is not None or self.critic is not None

    def parameters(self, model: torch.nn.Module) -> list[torch.nn.Parameter]:
        """Everything the policy's optimizer trains: the policy's parameters and the shared value head's."""
        return [*model.parameters(), *(self.value_head.parameters() if self.value_head is not None else ())]

    def trained_parameters(self, model: torch.nn.Module) -> list[torch.nn.Parameter]:
        """Every parameter an update moves: :meth:`parameters` and a separate critic's."""
        return [*self.parameters(model), *(self.critic.parameters() if self.critic is not None else ())]

    def parts(self) -> dict[str, Any]:
        return {"value_head": self.value_head, "proximal": self.proximal, "sfpo_switch": self.sfpo_switch,
                "critic": self.critic}

    def state_dict(self) -> dict[str, Any]:
        """The state of each part the algorithm uses (for checkpoints)."""
        return {name: part.state_dict() for name, part in self.parts().items() if part is not None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, part in self.parts().items():
            if part is not None:
                part.load_state_dict(state[name])


def make_update_state(algorithm: Algorithm, model: torch.nn.Module, trainer: Any = None) -> UpdateState:
    """The state of ``algorithm``'s update, made from the initial policy ``model``; ``trainer`` (the typed trainer
    config) gives a separate critic its optimizer's settings (rlbench.training.critic_model)."""
    settings, critic = algorithm.schedule_settings, algorithm.critic
    return UpdateState(
        value_head=make_value_head(model) if critic is not None and not critic.separate else None,
        proximal=EWMAPolicy(model, algorithm.proximal_decay or 0.0) if algorithm.needs_proximal_policy else None,
        sfpo_switch=SFPOSwitch(settings.entropy_window, settings.entropy_z) if isinstance(settings, SFPOSettings) else None,
        critic=SeparateCritic.from_policy(model, critic, trainer) if critic is not None and critic.separate else None,
    )


def apply_update_schedule(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: TrainBatch,
    algorithm: Algorithm,
    state: UpdateState,
    **options: Any,
) -> dict[str, float]:
    """One batch's update under ``algorithm.schedule``. ``options`` are standard_update's keyword
    arguments (micro_batch_size, max_grad_norm, temperature, norm_length, generator, progress, loss_streams)."""
    if algorithm.schedule == "none":  # Training-Free GRPO: no gradient, no optimizer step
        return {"optimizer_steps": 0.0}
    if algorithm.schedule == "trpo":
        return trpo_update(model, batch, algorithm, algorithm.schedule_settings, **options)
    options = {**options, "value_head": state.value_head, "proximal": state.proximal, "critic": state.critic}
    if algorithm.schedule == "sfpo":
        return sfpo_update(model, optimizer, batch, algorithm, state, **options)
    return standard_update(model, optimizer, batch, algorithm, **options)


def sfpo_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: TrainBatch,
    algorithm: Algorithm,
    state: UpdateState,
    **options: Any,
) -> dict[str, float]:
    """Slow-Fast Policy Optimization (Wang et al. 2025, "Slow-Fast Policy Optimization:
    Reposition-Before-Update for LLM Reasoning", arXiv:2510.04072):

        theta_{k+1} = update(theta_k) for k = 0..K-1           (fast: K full passes over the batch)
        theta~      = theta_0 + alpha (theta_K - theta_0)       (reposition)
        theta'      = update(theta~)                            (slow correction)

    Each ``update`` is one standard pass (epochs x minibatches optimizer steps) against the fixed
    old log-probs of the rollout policy. The optimizer's moments are kept through the inner steps
    and across the reposition (as in the released code). The trainable parameters, value head
    included, are repositioned. Once the entropy switch fires (``SFPOSwitch``), every later step is a
    single standard pass. Metrics: the mean of the passes' metrics, plus sfpo_active. A separate critic's
    parameters are repositioned as well (its optimizer's moments kept alike).
    """
    switch = state.sfpo_switch
    settings: SFPOSettings = algorithm.schedule_settings
    if switch is not None and not switch.active():
        stats = standard_update(model, optimizer, batch, algorithm, **options)
        switch.observe(stats.get("entropy", 0.0))
        return {**stats, "sfpo_active": 0.0}
    parameters = state.trained_parameters(model)
    start = [p.detach().clone() for p in parameters]
    passes = [standard_update(model, optimizer, batch, algorithm, **options) for _ in range(settings.fast_steps)]
    interpolate_(parameters, start, settings.alpha)
    passes.append(standard_update(model, optimizer, batch, algorithm, **options))
    stats = {key: sum(p[key] for p in passes) / len(passes) for key in passes[-1]}
    stats["optimizer_steps"] = sum(p["optimizer_steps"] for p in passes)
    if switch is not None:
        switch.observe(stats.get("entropy", 0.0))
    return {**stats, "sfpo_active": 1.0}


# --------------------------------------------------------------------------------------------------
# TRPO
# --------------------------------------------------------------------------------------------------


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _grad_or_zeros(grads: tuple[torch.Tensor | None, ...], params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]


def _token_kl(old_log_probs: torch.Tensor, log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum_t m_t KL(pi_old(.|s_t) || pi(.|s_t)) over the vocabulary (summed, not averaged)."""
    per_token = (old_log_probs.exp() * (old_log_probs - log_probs)).sum(-1)
    return (per_token * mask).sum()


class _TrustRegionProblem:
    """The pieces of one TRPO step on a batch: the loss, the Fisher-vector product and the KL to the
    policy at the start of the step, each accumulated over micro-batches. Micro-batch k's loss draws from
    ``loss_streams.at(k)`` each time it is evaluated, so the line search compares one objective."""

    def __init__(self, model, batch, algorithm, micro_batch_size, temperature, norm_length, progress,
                 loss_streams: LossStreams | None = None):
        self.model = model
        self.loss_streams = loss_streams
        self.batch = batch
        self.algorithm = algorithm
        self.temperature = temperature
        self.progress = progress
        rows = torch.arange(batch.size, device=batch.input_ids.device)
        self.norms = batch_norms(batch, rows, norm_length)
        self.parts = [batch.select(r) for r in micro_batches(rows, micro_batch_size)]
        self.tokens = max(self.norms["batch_tokens"], 1)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.old_log_probs: list[torch.Tensor] = []
        self.kl_gradients: list[torch.Tensor] = []

    def generator(self, index: int) -> torch.Generator | None:
        return None if self.loss_streams is None else self.loss_streams.at(index)

    def loss_gradient(self) -> tuple[float, torch.Tensor, dict[str, float]]:
        """L(theta_old), its gradient (flat) and the metrics; stores pi_old over the vocabulary."""
        grad = [torch.zeros_like(p) for p in self.params]
        total, metrics = 0.0, UpdateMetrics()
        for index, sub in enumerate(self.parts):
            loss, sub_metrics, out = micro_batch_loss(
                self.model, sub, self.algorithm, self.norms, self.temperature, progress=self.progress,
                with_log_probs=True, generator=self.generator(index),
            )
            parts = torch.autograd.grad(loss, self.params, allow_unused=True)
            grad = [g + part for g, part in zip(grad, _grad_or_zeros(parts, self.params))]
            self.old_log_probs.append(out.log_probs.detach())
            total += loss.item()
            metrics.add(sub_metrics, float(sub.response_mask.sum().item()))
        return total, _flat(grad), metrics.result(1)

    def prepare_fisher(self) -> None:
        """grad KL(pi_theta_old || pi_theta) at theta_old, kept with its graph, so that each Fisher
        product is one more backward pass (no new forward). Attention runs in its plain math form,
        which has second derivatives."""
        with sdpa_kernel(SDPBackend.MATH):
            for sub in self.parts:
                log_probs = token_outputs(self.model, sub, self.temperature, with_log_probs=True).log_probs
                kl = _token_kl(log_probs.detach(), log_probs, sub.response_mask) / self.tokens
                grads = torch.autograd.grad(kl, self.params, create_graph=True, allow_unused=True)
                self.kl_gradients.append(_flat(_grad_or_zeros(grads, self.params)))

    def fisher_vector_product(self, vector: torch.Tensor, damping: float) -> torch.Tensor:
        """(F + damping I) v, with F the Hessian of the token-mean KL at theta_old (= the Fisher
        information of the token distributions), by double backprop: F v = grad( grad(KL) . v )."""
        if not self.kl_gradients:
            self.prepare_fisher()
        product = damping * vector
        for kl_gradient in self.kl_gradients:
            if kl_gradient.requires_grad:
                second = torch.autograd.grad(torch.dot(kl_gradient, vector), self.params, retain_graph=True, allow_unused=True)
                product = product + _flat(_grad_or_zeros(second, self.params))
        return product

    def release_fisher(self) -> None:
        self.kl_gradients.clear()

    @torch.no_grad()
    def loss_and_kl(self) -> tuple[float, float]:
        """L(theta) and the token-mean KL(pi_old || pi_theta) at the current parameters."""
        total, kl = 0.0, 0.0
        for index, (sub, old) in enumerate(zip(self.parts, self.old_log_probs)):
            loss, _, out = micro_batch_loss(
                self.model, sub, self.algorithm, self.norms, self.temperature, progress=self.progress,
                track_entropy=False, with_log_probs=True, generator=self.generator(index),
            )
            total += loss.item()
            kl += _token_kl(old, out.log_probs, sub.response_mask).item()
        return total, kl / self.tokens


def trpo_update(
    model: torch.nn.Module,
    batch: TrainBatch,
    algorithm: Algorithm,
    settings: TRPOSettings,
    *,
    micro_batch_size: int,
    temperature: float,
    norm_length: int,
    progress: float = 0.0,
    loss_streams: LossStreams | None = None,
    **_ignored: Any,
) -> dict[str, float]:
    """Trust Region Policy Optimization (Schulman et al. 2015, "Trust Region Policy Optimization",
    arXiv:1502.05477, Sec. 6 and App. C), generic over the model's trainable parameters:

        g     = grad L(theta_old)                      L: the algorithm's loss (the negated surrogate)
        s     = F^{-1} (-g)                            conjugate gradient, F + damping I (Fisher of the
                                                       token-mean KL(pi_old || pi_theta) at theta_old)
        step  = sqrt(2 delta / s^T F s) s
        theta = theta_old + b^j step                   smallest j >= 0 with KL(pi_old || pi_theta) <= delta
                                                       and L(theta) < L(theta_old); else theta_old

    No optimizer, learning rate or gradient clipping is involved. The KL is exact over the
    vocabulary, so pi_old's full distribution over the batch ([B, T, V] floats) is kept during the
    step, and the graph of grad KL is kept through the conjugate gradient so that each
    Fisher-vector product is one more backward pass. That suits small models (or adapters), not full
    LLMs. ``max_grad_norm``, ``generator`` and the optimizer are
    not used. Metrics: the algorithm's metrics at theta_old, trpo_kl (accepted step's KL), trpo_step
    (b^j of the accepted step, 0 if none), trpo_improvement (L_old - L_new), grad_norm.
    """
    model.train()
    problem = _TrustRegionProblem(model, batch, algorithm, micro_batch_size, temperature, norm_length, progress,
                                  loss_streams)
    loss_old, grad, stats = problem.loss_gradient()
    direction = conjugate_gradient(
        lambda v: problem.fisher_vector_product(v, settings.damping), -grad, settings.cg_iters
    )
    curvature = float(torch.dot(direction, problem.fisher_vector_product(direction, settings.damping)))
    problem.release_fisher()
    step = trust_region_scale(curvature, settings.max_kl) * direction
    theta_old = torch.nn.utils.parameters_to_vector(problem.params).detach().clone()
    accepted, kl, loss_new = 0.0, 0.0, loss_old
    if step.abs().sum() > 0:
        for j in range(settings.line_search_steps):
            fraction = settings.backtrack**j
            torch.nn.utils.vector_to_parameters(theta_old + fraction * step, problem.params)
            candidate_loss, candidate_kl = problem.loss_and_kl()
            if candidate_kl <= settings.max_kl and candidate_loss < loss_old:
                accepted, kl, loss_new = fraction, candidate_kl, candidate_loss
                break
        else:
            torch.nn.utils.vector_to_parameters(theta_old, problem.params)
    stats.update(
        trpo_kl=kl, trpo_step=accepted, trpo_improvement=loss_old - loss_new,
        grad_norm=float(grad.norm()), optimizer_steps=1.0 if accepted else 0.0,
    )
    return stats
