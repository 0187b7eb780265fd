"""RTO's dense token reward: DPO's implicit token reward inside PPO.

Zhong et al. 2024, "DPO Meets PPO: Reinforced Token Optimization for RLHF", arXiv:2404.18922
(sec. 4, practical implementation). A DPO model pi_dpo (trained against the same reference pi_ref)
defines the token-wise reward of the token-level MDP

    r_t = clip_c(beta_dpo (log pi_dpo(y_t|x,y_<t) - log pi_ref(y_t|x,y_<t)))   (clip_c: clamp to [-c, c]; c = 0: none)
          - beta_kl k_t                                   (the usual KL penalty to pi_ref, k_t = k(old, ref))
          + 1[t = last token] beta_sparse R(x, y)         (the sparse sequence-level reward)

which PPO's GAE (rlbench/algorithm/advantages/value_based.py) reads as ``token_rewards``. The sum of
the dense terms over a response is the sequence-level DPO implicit reward beta_dpo log pi_dpo(y|x)/pi_ref(y|x)
(the DPO partition function cancels between tokens, arXiv:2404.18922 sec. 3). With beta_dpo = 0 the
reward is PPO's sparse (KL-penalised) reward exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlbench.algorithm.kl import kl_penalised_rewards
from rlbench.algorithm.schedules import settings_from_block
from rlbench.errors import ConfigError

#: config.json fields a DPO checkpoint must share with the policy (same architecture and token ids).
MATCHING_CONFIG_FIELDS = ("model_type", "architectures", "vocab_size")


def dpo_token_rewards(
    dpo_logp: torch.Tensor, ref_logp: torch.Tensor, response_mask: torch.Tensor, beta_dpo: float, clip: float = 0.0
) -> torch.Tensor:
    """[B,T] float64 beta_dpo (log pi_dpo - log pi_ref) per response token, 0 on padding
    (arXiv:2404.18922 sec. 4, the DPO model's token-wise implicit reward); clip > 0 clamps each token's
    reward to [-clip, clip] (the authors' release, github.com/zkshan2002/RTO: --dpo_reward_clip 0.05)."""
    mask = response_mask.to(torch.float64)
    dense = beta_dpo * (dpo_logp.to(torch.float64) - ref_logp.to(torch.float64))
    if clip > 0:
        dense = dense.clamp(-clip, clip)
    return dense * mask


def rto_rewards(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    dpo_logp: torch.Tensor,
    ref_logp: torch.Tensor,
    beta_dpo: float,
    sparse_coef: float = 1.0,
    kl_matrix: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    dpo_clip: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence rewards [B], token rewards [B,T]) of RTO (arXiv:2404.18922 sec. 4).

    token rewards = dense DPO reward + the sparse reward sparse_coef R on the last token - kl_coef k_t
    (``kl_penalised_rewards``); the sequence reward is their sum over the response."""
    mask = response_mask.to(torch.float64)
    kl = torch.zeros_like(mask) if kl_matrix is None else kl_matrix.to(torch.float64)
    _, sparse_and_kl = kl_penalised_rewards(sparse_coef * rewards.to(torch.float64), kl, mask, kl_coef)
    token_rewards = sparse_and_kl + dpo_token_rewards(dpo_logp, ref_logp, response_mask, beta_dpo, dpo_clip)
    return token_rewards.sum(-1), token_rewards


@dataclass(frozen=True)
class RTOSettings:
    """``algorithm.rto`` (arXiv:2404.18922 sec. 4): ``dpo_model`` the frozen pi_dpo's Hugging Face folder,
    ``beta_dpo`` beta_1 of the dense DPO term, ``sparse_coef`` beta_2 of the sparse verifier reward, ``dpo_clip``
    the clamp of each dense term (0: none). beta_KL is
    algorithm.kl.coef with algorithm.kl.placement=reward (the KL's own machinery, rlbench/algorithm/kl.py).
    The defaults are the schema's (rlbench/config/schema.py, RTOConfig)."""

    dpo_model: str | None
    beta_dpo: float
    sparse_coef: float
    dpo_clip: float

    @classmethod
    def from_config(cls, node: Any) -> RTOSettings | None:
        """None when ``algorithm.rto`` is absent or null (no dense DPO reward)."""
        return None if node is None else settings_from_block(cls, node, "algorithm.rto")

    def check(self) -> None:
        if self.beta_dpo < 0 or self.sparse_coef < 0 or self.dpo_clip < 0:
            raise ConfigError(f"algorithm.rto.beta_dpo, .sparse_coef and .dpo_clip must be >= 0 (got {self.beta_dpo}, "
                              f"{self.sparse_coef}, {self.dpo_clip})")

    @staticmethod
    def check_composition(advantage_reads_token_rewards: bool, kl_coef: float, kl_placement: str) -> None:
        """Refuses, before anything loads, compositions in which the dense reward would not act as RTO's."""
        if not advantage_reads_token_rewards:
            raise ConfigError("algorithm.rto puts DPO's reward on every token; the advantage must read per-token rewards "
                              "(token_rewards), e.g. algorithm/advantage=gae (algorithm=rto)")
        if kl_coef > 0 and kl_placement != "reward":
            raise ConfigError("algorithm.rto's KL penalty -beta_KL k_t is a term of the token reward: set "
                              "algorithm.kl.placement=reward (or algorithm.kl.coef=0)")


def _model_config(path: Path, what: str) -> dict[str, Any]:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"{what} {path} has no config.json (expected a Hugging Face model folder)")
    return json.loads(config_file.read_text())


def check_dpo_checkpoint(dpo_path: str | None, policy_path: str) -> None:
    """Refuses, before any model loads, a missing DPO checkpoint or one whose architecture or
    vocabulary differs from the policy's (its log-probs would not be of the policy's token ids)."""
    if not dpo_path:
        raise ConfigError(
            "algorithm=rto needs algorithm.rto.dpo_model: a Hugging Face folder of a DPO model of the "
            "policy's architecture (e.g. a run of algorithm=dpo with trainer.save_model=true)"
        )
    path = Path(dpo_path)
    if not path.is_dir():
        raise ConfigError(f"algorithm.rto.dpo_model {dpo_path} is not a folder")
    dpo = _model_config(path, "algorithm.rto.dpo_model")
    policy_dir = Path(policy_path)
    if not policy_path or not policy_dir.is_dir():
        return  # not a folder (a hub name, a tiny model): the weights' names and shapes are checked when pi_dpo loads
    policy = _model_config(policy_dir, "the policy model")
    for field in MATCHING_CONFIG_FIELDS:
        if dpo.get(field) != policy.get(field):
            raise ConfigError(
                f"algorithm.rto.dpo_model {dpo_path} is of another model: {field} "
                f"{dpo.get(field)!r} != the policy's {policy.get(field)!r}"
            )
    dpo_vocab, policy_vocab = path / "tokenizer.json", policy_dir / "tokenizer.json"
    if dpo_vocab.is_file() and policy_vocab.is_file() and dpo_vocab.read_bytes() != policy_vocab.read_bytes():
        raise ConfigError(f"algorithm.rto.dpo_model {dpo_path} has another tokenizer than the policy")


def check_rto_run(settings: RTOSettings | None, policy_path: str, lora: bool, parallelism: str) -> None:
    """The run's RTO before any weights load: the DPO checkpoint (``check_dpo_checkpoint``; ``policy_path``
    the policy's folder, "" when it is not one), and the setups pi_dpo has no place in yet."""
    if settings is None:
        return
    check_dpo_checkpoint(settings.dpo_model, policy_path)
    if lora:
        raise ConfigError("algorithm.rto loads pi_dpo into a full frozen copy of the policy; under LoRA the reference is "
                          "the base model with adapters off (no copy): drop model/lora (or merge the adapters first)")
    if parallelism != "single":
        raise ConfigError(f"algorithm.rto is not supported under trainer.parallelism={parallelism} yet (pi_dpo is not sharded)")
