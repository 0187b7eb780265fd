"""PPO's separate critic (``algorithm.critic.model=separate``): the value model LLM PPO implementations train
beside the actor (verl's and OpenRLHF's critic workers), instead of the value head on the policy's backbone
(rlbench/algorithm/critic.py, the default ``shared``).

    V_phi(q, o_<t) = w . h_phi(q, o_<t) + b        h_phi: the final hidden state of the critic's own backbone

The critic is a :class:`rlbench.algorithm.value_model.ValueModel`: a copy of the initial policy's weights with a
zero-initialised value head (V = 0 at the start, as the shared head). It is trained by its own AdamW (the
trainer's betas and weight decay, learning rate ``algorithm.critic.lr``, constant: trainer.warmup_steps warms up
the policy only), on the value loss of the same mini-batches, epochs and micro-batches as the actor
(rlbench.training.update.standard_update): each micro-batch's objective L = L_policy + c_v L_value is
backpropagated once, and as the two models share no parameter, the policy's gradient is that of L_policy and the
critic's that of c_v L_value (AdamW's step is nearly invariant to c_v; its gradient norm is clipped at
trainer.max_grad_norm on its own). After each mini-batch both optimizers step.

Under LoRA (``model.lora``) the copy is the policy's peft model: the critic trains its own adapter (same rank and
targets) and its head on its own frozen copy of the base weights. Per-role adapters and several ranks are refused
before the model loads (rlbench/validation.py, rlbench/training/distributed.py).

The critic's weights and its optimizer's state are checkpointed with the update state (a resumed run equals the
uninterrupted one); like the shared head it is not saved with the policy at the end of a run.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch

from rlbench.algorithm.critic import CriticSettings
from rlbench.algorithm.value_model import ValueModel
from rlbench.training.distributed import gradient_norm, unwrap


class SeparateCritic:
    """The critic model and its optimizer (module docstring)."""

    def __init__(self, model: ValueModel, optimizer: torch.optim.Optimizer):
        self.model = model
        self.optimizer = optimizer

    @classmethod
    def from_policy(cls, policy: torch.nn.Module, settings: CriticSettings, trainer: Any = None) -> "SeparateCritic":
        """A copy of ``policy`` (the initial one) with a zero value head and a fresh AdamW at ``settings.lr`` (null:
        trainer.lr), with the trainer's betas and weight decay (``trainer``: the typed trainer config; None: AdamW's
        defaults, ``settings.lr`` required)."""
        lr = settings.lr if settings.lr is not None else getattr(trainer, "lr", None)
        if lr is None:
            raise ValueError("the separate critic needs a learning rate: algorithm.critic.lr or trainer.lr")
        model = ValueModel(copy.deepcopy(unwrap(policy)))
        options = {} if trainer is None else {"betas": tuple(trainer.betas), "weight_decay": trainer.weight_decay}
        # fused: one kernel over all parameters, as the policy's AdamW (rlbench/training/step.py)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, fused=True, **options)
        return cls(model, optimizer)

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def step(self, max_grad_norm: float | None) -> float:
        """One optimizer step on the accumulated gradient (clipped at ``max_grad_norm``); returns its norm."""
        clip = max_grad_norm if max_grad_norm is not None and max_grad_norm > 0 else math.inf
        norm = gradient_norm(torch.nn.utils.clip_grad_norm_(self.parameters(), clip))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
