"""An algorithm = advantage estimator x policy loss x aggregation x KL x entropy x update schedule.

``Algorithm.from_config`` reads ``cfg.algorithm`` (see conf/algorithm/*.yaml); the two methods
below are the whole objective, read top to bottom:

    rewards    = shape(outcome) [- kl_coef * sum_t kl(old_logp, ref_logp)   (kl.placement=reward)]
    advantages = advantage_estimator(rewards, groups)
    loss       = aggregate(token_mask * w * policy_loss(logp, old_logp, A))
               + kl_coef * aggregate(s * kl(logp, ref_logp))                (kl.placement=loss)
               - entropy_coef * aggregate(H)
               + positive_nll_coef * aggregate_C(-logp)                     (correct responses C only)
               + critic.coef * aggregate(value_loss(V, V_old, R))            (value head only)

kl_coef and entropy_coef are fixed, or adapted after every step (kl.adaptive, entropy_adaptive);
the token mask is 1, or the top-entropy-quantile mask (token_mask.top_entropy_quantile), or D3S's
|A| H mask on the responses D3S keeps (algorithm.downsampling, downsampling.py); w is 1,
or the truncated importance weight between the sampling engine and the trainer
(sampling_correction, sampling_correction.py). ``kl`` is the estimator ``kl.estimator`` (with
``kl.clamp`` for k3 / k3+, kl.py); s is 1, or each response's factor by its curriculum difficulty label
(kl.difficulty_scale: CLPO's dynamic KL, kl.difficulty_kl_scale). ``algorithm.update.schedule`` (standard | sfpo | trpo, see
schedules.py) says how that loss becomes parameter changes. aggregate_C is the aggregation over the
correct responses' tokens only, normalised by their counts in the optimizer batch (``positive_nll``). What each piece needs of the others
(aggregation, advantage level) it declares where it is registered (registry.Needs).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

import rlbench.algorithm.aggregation  # noqa: F401  (registers pieces; advantages, kl and losses by the imports below)
from rlbench.algorithm.entropy import AdaptiveEntropy, top_entropy_token_mask
from rlbench.algorithm.kl import DIFFICULTY_LABELS, KL_PLACEMENTS, AdaptiveKL, kl_penalised_rewards, sequence_kl
from rlbench.algorithm.advantages import value_loss
from rlbench.algorithm.critic import CRITIC_ADVANTAGE, CRITIC_RETURNS, CriticSettings
from rlbench.algorithm.advantages.verl_pieces import PolicyFiltration
from rlbench.algorithm.downsampling import DownSampling
from rlbench.algorithm.losses import masked_mean
from rlbench.algorithm.losses.auxiliary_sft import target_nll
from rlbench.algorithm.sampling_correction import SamplingCorrection
from rlbench.algorithm.schedules import SFPOSettings, TRPOSettings, schedule_from_config
from rlbench.algorithm.registry import ADVANTAGES, AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES
from rlbench.algorithm.rto import RTOSettings, rto_rewards
from rlbench.algorithm.shaping import apply_shaping, check_shapers, length_target_instruction
from rlbench.algorithm.step_inputs import STEP_INPUTS
from rlbench.errors import ConfigError

# The inputs the step computes before the advantage (forward passes, the graded groups, the step's
# KL-in-reward token rewards); the rest come from sources and strategies (rlbench/training/advantage_inputs.py).
STEP_COMPUTED_PRODUCERS = ("forward", "graded", "step")


def setting(node: Mapping[str, Any], key: str, where: str = "") -> Any:
    """``node[key]`` of the algorithm config, a ConfigError when it is missing: the caller passes every key
    (rlbench.config.typed.algorithm_settings), so no default is written in this layer."""
    if key not in node:
        path = ".".join(part for part in ("algorithm", where, key) if part)
        raise ConfigError(f"{path} is missing: Algorithm.from_config reads every key of the algorithm config, with the "
                          "schema's defaults filled in (rlbench.config.typed.algorithm_settings)")
    return node[key]


def difficulty_scales(node: Mapping[str, Any] | None) -> dict[str, float] | None:
    """``algorithm.kl.difficulty_scale`` as {label: factor}, None when every factor is 1 (the plain KL term, no
    per-response input)."""
    scales = {str(label): float(value) for label, value in dict(node or {}).items()}
    return None if all(value == 1.0 for value in scales.values()) and set(scales) <= set(DIFFICULTY_LABELS) else scales


@dataclass(frozen=True)
class Piece:
    """A registered function name plus its YAML parameters."""

    name: str
    params: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_config(cls, node: Any, what: str) -> "Piece":
        if node is None or "name" not in node:
            raise ConfigError(f"algorithm.{what} needs a 'name' (e.g. algorithm/{what}=<option>)")
        params = {k: v for k, v in dict(node).items() if k != "name"}
        return cls(str(node["name"]), params)


@dataclass
class Coefficients:
    """The run's current KL and entropy coefficients (they move when adaptive) and the last entropy."""

    kl: float
    entropy: float
    last_entropy: float | None = None


@dataclass(frozen=True)
class Algorithm:
    name: str
    advantage: Piece
    loss: Piece
    aggregation: Piece
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_clamp: float | None = None  # value clamp of k3 / k3+ (algorithm.kl.clamp; verl's low_var_kl: 10)
    entropy_coef: float = 0.0
    positive_nll_coef: float = 0.0  # the NLL of the correct responses beside the loss (CE-GPPO's scripts: 0.1)
    epochs: int = 1
    minibatches: int = 1
    reward_shaping: tuple[Piece, ...] = ()
    critic: CriticSettings | None = None  # PPO's critic: a value head on the policy, or a separate model
    schedule: str = "standard"  # standard | sfpo | trpo
    schedule_settings: SFPOSettings | TRPOSettings | None = None
    proximal_decay: float | None = None  # beta of the EWMA proximal policy (ppo_ewma); None -> 0
    round_steps: int | None = None  # iterative rounds: the loss's pi_t frozen for this many steps (training/rounds.py)
    round_sampling: str = "pi_t"  # with round_steps: pi_t (the frozen copy) or the policy samples a round's batches
    kl_placement: str = "loss"
    kl_adaptive: AdaptiveKL | None = None
    kl_previous_weight: float = 0.0  # w of the convex KL (1 - w) KL(pi || pi_ref) + w KL(pi || pi_prev) (ReMix)
    # CLPO's dynamic KL: the loss's KL of a response times its difficulty label's factor (None: every factor 1)
    kl_difficulty_scale: Mapping[str, float] | None = None
    entropy_adaptive: AdaptiveEntropy | None = None
    top_entropy_quantile: float | None = None
    sampling_correction: SamplingCorrection | None = None  # TIS weights between sampler and trainer
    downsampling: DownSampling | None = None  # D3S: the responses and tokens a step trains on
    pf_ppo: PolicyFiltration | None = None  # PF-PPO: the trained batch re-sampled by reward
    rto: RTOSettings | None = None  # RTO: a frozen DPO model's token reward inside the (PPO) reward
    reference_samples: int = 0  # QRPO: K pi_ref samples per prompt as the reference set (0: the group; training/reference_rewards.py)
    preference_model: bool = False  # DRPO: a preference model fitted before the actor scores the responses (training/preference_model.py)
    online_prm: str | None = None  # OPRL: an implicit PRM trained online beside the policy, its baseline (training/online_prm.py)
    # Mutable run state inside the frozen composition: each from_config starts a fresh one.
    coefficients: Coefficients | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.coefficients is None:
            object.__setattr__(self, "coefficients", Coefficients(kl=self.kl_coef, entropy=self.entropy_coef))

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> "Algorithm":
        """Build from ``algorithm`` with every key present (rlbench.config.typed.algorithm_settings fills the
        schema's defaults: they are written there once), and check every piece and parameter exists. A
        missing key is a ConfigError, never a default of this layer's own."""
        kl, update = setting(cfg, "kl"), setting(cfg, "update")
        token_mask = dict(setting(cfg, "token_mask"))
        if set(token_mask) - {"top_entropy_quantile"}:
            raise ConfigError(f"algorithm.token_mask takes only top_entropy_quantile, got {sorted(token_mask)}")
        quantile = token_mask.get("top_entropy_quantile")
        schedule, schedule_settings = schedule_from_config(setting(update, "schedule", "update"), update)
        proximal_decay, clamp = setting(update, "proximal_decay", "update"), setting(kl, "clamp", "kl")
        algorithm = cls(
            name=str(setting(cfg, "name")),
            advantage=Piece.from_config(setting(cfg, "advantage"), "advantage"),
            loss=Piece.from_config(setting(cfg, "loss"), "loss"),
            aggregation=Piece.from_config(setting(cfg, "aggregation"), "aggregation"),
            kl_coef=float(setting(kl, "coef", "kl")),
            kl_estimator=str(setting(kl, "estimator", "kl")),
            kl_clamp=None if clamp is None else float(clamp),
            entropy_coef=float(setting(cfg, "entropy_coef")),
            positive_nll_coef=float(setting(cfg, "positive_nll_coef")),
            epochs=int(setting(update, "epochs", "update")),
            minibatches=int(setting(update, "minibatches", "update")),
            reward_shaping=tuple(Piece.from_config(node, "reward_shaping") for node in setting(cfg, "reward_shaping")),
            kl_placement=str(setting(kl, "placement", "kl")),
            kl_adaptive=None if (adaptive := setting(kl, "adaptive", "kl")) is None else AdaptiveKL.from_config(adaptive),
            kl_previous_weight=float(setting(kl, "previous_weight", "kl")),
            kl_difficulty_scale=difficulty_scales(setting(kl, "difficulty_scale", "kl")),
            entropy_adaptive=None if (entropy := setting(cfg, "entropy_adaptive")) is None else AdaptiveEntropy.from_config(entropy),
            top_entropy_quantile=None if quantile is None else float(quantile),
            sampling_correction=SamplingCorrection.from_config(setting(cfg, "sampling_correction")),
            downsampling=DownSampling.from_config(setting(cfg, "downsampling")),
            pf_ppo=PolicyFiltration.from_config(setting(cfg, "pf_ppo")),
            rto=RTOSettings.from_config(setting(cfg, "rto")),
            reference_samples=0 if (qrpo := setting(cfg, "qrpo")) is None else int(setting(qrpo, "reference_samples", "qrpo")),
            preference_model=setting(cfg, "preference_model") is not None,
            online_prm=None if (prm := setting(cfg, "online_prm")) is None else str(setting(prm, "baseline", "online_prm")),
            critic=CriticSettings.from_config(setting(cfg, "critic")),
            schedule=schedule,
            schedule_settings=schedule_settings,
            proximal_decay=None if proximal_decay is None else float(proximal_decay),
            round_steps=None if (rounds := setting(update, "round_steps", "update")) is None else int(rounds),
            round_sampling=str(setting(update, "round_sampling", "update")),
        )
        algorithm.validate()
        return algorithm

    def validate(self) -> None:
        ADVANTAGES.validate_params(self.advantage.name, self.advantage.params)
        POLICY_LOSSES.validate_params(self.loss.name, self.loss.params)
        self._check_critic_and_schedule()
        if (self.online_prm is not None) != ("step_process_rewards" in ADVANTAGES.accepted_inputs(self.advantage.name)):
            readers = [name for name in ADVANTAGES.names() if "step_process_rewards" in ADVANTAGES.accepted_inputs(name)]
            raise ConfigError(f"algorithm.online_prm (OPRL's implicit PRM) and the advantages that read its step rewards "
                              f"{readers} go together; advantage '{self.advantage.name}' "
                              + ("does not read them: remove algorithm.online_prm" if self.online_prm is not None else
                                 "reads them: set algorithm.online_prm={beta: 0.05, lr: 1e-6, updates: 1}"))
        for registry, piece in ((ADVANTAGES, self.advantage), (POLICY_LOSSES, self.loss)):
            provided = STEP_INPUTS.provided(registry.reader, self)  # rlbench/algorithm/step_inputs.py
            missing = sorted(registry.required_inputs(piece.name, piece.params) - provided)
            if missing:
                raise ConfigError(
                    f"{registry.kind} '{piece.name}' needs {missing}, which this trainer does not provide "
                    f"(it provides {sorted(provided)}); pick another algorithm/{'advantage' if registry is ADVANTAGES else 'loss'}"
                )
        AGGREGATIONS.validate_params(self.aggregation.name, self.aggregation.params)
        if self.reference_samples < 0:
            raise ConfigError(f"algorithm.qrpo.reference_samples must be >= 0 (0: the group is the reference set), got {self.reference_samples}")
        if self.reference_samples and "reference_rewards" not in POLICY_LOSSES.accepted_inputs(self.loss.name):
            readers = [name for name in POLICY_LOSSES.names() if "reference_rewards" in POLICY_LOSSES.accepted_inputs(name)]
            raise ConfigError(f"algorithm.qrpo.reference_samples={self.reference_samples} samples a reference set that only "
                              f"the losses {readers} read, not loss '{self.loss.name}': remove algorithm.qrpo")
        if self.preference_model and "preference_scores" not in POLICY_LOSSES.accepted_inputs(self.loss.name):
            readers = [name for name in POLICY_LOSSES.names() if "preference_scores" in POLICY_LOSSES.accepted_inputs(name)]
            raise ConfigError(f"algorithm.preference_model fits a preference model that only the losses {readers} read, "
                              f"not loss '{self.loss.name}': remove algorithm.preference_model")
        if self.rto is not None:
            self.rto.check_composition("token_rewards" in self.advantage_inputs, self.kl_coef, self.kl_placement)
        check_shapers([(s.name, s.params) for s in self.reward_shaping])
        self._check_loss_requirements()
        KL_ESTIMATORS.validate_params(self.kl_estimator, self.kl_estimator_params)
        if self.kl_clamp is not None and self.kl_clamp <= 0:
            raise ConfigError(f"algorithm.kl.clamp must be > 0 (verl's low_var_kl uses 10), got {self.kl_clamp}")
        if self.kl_coef < 0 or self.entropy_coef < 0 or self.positive_nll_coef < 0:
            raise ConfigError("algorithm.kl.coef, algorithm.entropy_coef and algorithm.positive_nll_coef must be >= 0")
        self._check_kl_and_entropy_settings()
        self._check_downsampling()
        self._check_whole_group_loss()
        if self.epochs < 1 or self.minibatches < 1:
            raise ConfigError("algorithm.update.epochs and algorithm.update.minibatches must be >= 1")

    def _check_kl_and_entropy_settings(self) -> None:
        if self.kl_placement not in KL_PLACEMENTS:
            raise ConfigError(f"algorithm.kl.placement={self.kl_placement} is unknown; choose one of {KL_PLACEMENTS}")
        if self.kl_difficulty_scale is not None and (
                set(self.kl_difficulty_scale) != set(DIFFICULTY_LABELS) or min(self.kl_difficulty_scale.values()) < 0):
            raise ConfigError(f"algorithm.kl.difficulty_scale takes a factor >= 0 for each of {list(DIFFICULTY_LABELS)}, "
                              f"got {dict(self.kl_difficulty_scale)}")
        if self.kl_difficulty_scale is not None and not self.kl_in_loss:
            raise ConfigError("algorithm.kl.difficulty_scale scales the loss's KL term: it needs algorithm.kl.coef > 0 "
                              "and placement=loss")
        if not 0 <= self.kl_previous_weight <= 1:
            raise ConfigError(f"algorithm.kl.previous_weight must be in [0, 1], got {self.kl_previous_weight}")
        if self.kl_previous_weight > 0 and not self.kl_in_loss:
            raise ConfigError(
                "algorithm.kl.previous_weight > 0 mixes the KL to the previous policy into the loss's KL term: it needs "
                f"algorithm.kl.coef > 0 and placement=loss (got coef={self.kl_coef}, placement={self.kl_placement})"
            )
        if self.kl_adaptive is not None and self.kl_coef == 0:
            raise ConfigError(
                "algorithm.kl.adaptive multiplies the coefficient, which stays 0 from algorithm.kl.coef=0; "
                "set an initial algorithm.kl.coef > 0 or drop kl.adaptive"
            )
        if self.top_entropy_quantile is not None and not 0 < self.top_entropy_quantile <= 1:
            raise ConfigError(
                f"algorithm.token_mask.top_entropy_quantile must be in (0, 1] (the paper uses 0.2), "
                f"got {self.top_entropy_quantile}"
            )

    def check_batch_size(self, responses: int) -> None:
        """Checks that need the number of responses per batch (called by the config validator)."""
        if self.kl_adaptive is not None:
            self.kl_adaptive.check_batch(responses)

    def check_group_size(self, group_size: int, responses: int) -> None:
        """Checks that need the responses per prompt and per batch (called by the config validator for
        the run's batch and every stage's): D3S's first kept subset."""
        if self.downsampling is not None:
            self.downsampling.check_sizes(group_size, responses)

    def _check_downsampling(self) -> None:
        """D3S's sample level ranks responses within their group (scope=group): it needs a group-relative
        advantage; its token level multiplies the token loss matrix: it needs a loss with a ratio per
        token, and it replaces the top-entropy mask rather than stacking on it."""
        settings = self.downsampling
        if settings is None:
            return
        if settings.scope == "group" and not self.group_relative:
            raise ConfigError(
                f"algorithm.downsampling.scope=group keeps a subset of each prompt's group, but advantage "
                f"'{self.advantage.name}' is not group-relative; use algorithm.downsampling.scope=batch (cross-group)"
            )
        if self.top_entropy_quantile is not None:
            raise ConfigError(
                "algorithm.downsampling (D3S) masks tokens by |A| H and algorithm.token_mask.top_entropy_quantile by H; "
                "set one of them (algorithm.token_mask.top_entropy_quantile=null)"
            )
        if settings.masks_tokens and POLICY_LOSSES.needs(self.loss.name).ratio_level == "sequence":
            raise ConfigError(
                f"loss '{self.loss.name}' forms one importance ratio per response, so a token mask cannot select "
                f"tokens of its policy gradient; D3S's token level (algorithm.downsampling.tokens={settings.tokens}) needs "
                "a token-level loss (e.g. algorithm/loss=gspo_token), or set algorithm.downsampling.tokens=1.0"
            )

    def _check_whole_group_loss(self) -> None:
        """A pairwise loss (registry.Needs.whole_groups) is a mean over groups of its pairs' losses: the
        terms that weigh tokens (a token mask, D3S, the sampler's importance weights, an entropy bonus or a
        KL term aggregated like the loss) would change that objective, and its own coefficient (beta) is
        already the strength of its KL to pi_ref; sfpo and trpo split the batch without regard to groups."""
        if not self.loss_reads_whole_groups:
            return
        conflicting = {
            "algorithm.pf_ppo": self.pf_ppo is not None,
            "algorithm.kl.coef > 0": self.kl_coef > 0,
            "algorithm.entropy_coef > 0 (or entropy_adaptive)": self.uses_entropy_bonus,
            "algorithm.positive_nll_coef > 0": self.positive_nll_coef > 0,
            "algorithm.token_mask.top_entropy_quantile": self.top_entropy_quantile is not None,
            "algorithm.downsampling": self.downsampling is not None,
            "algorithm.sampling_correction": self.sampling_correction is not None,
            f"algorithm.update.schedule={self.schedule}": self.schedule != "standard",
        }
        found = [name for name, present in conflicting.items() if present]
        if found:
            raise ConfigError(
                f"loss '{self.loss.name}' is a pairwise preference loss ({POLICY_LOSSES.needs(self.loss.name).whole_groups}); "
                f"it does not combine with {', '.join(found)}: its beta is already its KL to pi_ref, and the mean "
                "over groups of the pairs' losses is its objective (docs/preference.md)"
            )

    def _check_critic_and_schedule(self) -> None:
        """Refuse a value head without an estimator that reads values (and the reverse), and update
        schedules combined with pieces they cannot drive."""
        advantage, loss = self.advantage.name, self.loss.name
        if "values" in ADVANTAGES.accepted_inputs(advantage) and self.critic is None:
            raise ConfigError(
                f"advantage '{advantage}' needs critic values, but this algorithm has no value head "
                f"(gae without a value head); add one with algorithm.critic (e.g. algorithm=ppo, or "
                f"+algorithm.critic.coef=0.5) or pick another algorithm/advantage"
            )
        if self.critic is not None and advantage not in CRITIC_RETURNS:
            raise ConfigError(
                f"algorithm.critic adds a value head, but advantage '{advantage}' does not use values, so the "
                f"critic would train for nothing (a separate critic model too); use algorithm/advantage={CRITIC_ADVANTAGE} "
                f"or remove algorithm.critic"
            )
        if self.schedule == "trpo" and self.critic is not None:
            raise ConfigError(
                "algorithm.update.schedule=trpo takes one natural-gradient step on the policy and has no "
                "gradient steps for a value head or a separate critic (algorithm.critic); use schedule standard or sfpo "
                "with a critic"
            )
        if self.schedule == "trpo" and self.needs_proximal_policy:
            raise ConfigError(
                f"loss '{loss}' measures its trust region against an EWMA proximal policy that follows "
                f"optimizer steps; algorithm.update.schedule=trpo takes none (its trust region is the KL line "
                f"search); use loss is_surrogate or ppo_clip with trpo, or schedule standard with {loss}"
            )
        if self.proximal_decay is not None:
            if not self.needs_proximal_policy:
                raise ConfigError(
                    f"algorithm.update.proximal_decay is the EWMA decay of a proximal policy, which only a loss "
                    f"reading prox_logp (ppo_ewma) uses; loss '{loss}' does not, so remove the key"
                )
            if not 0.0 <= self.proximal_decay < 1.0:
                raise ConfigError(f"algorithm.update.proximal_decay must be in [0, 1), got {self.proximal_decay}")
        self._check_rounds()

    def _check_rounds(self) -> None:
        """algorithm.update.round_steps holds the loss's pi_old frozen for a round: only a loss whose pi_old is an
        iterative method's pi_t (registry.Needs.rounds) means anything by that; a ratio to a stale pi_old would not."""
        if self.round_steps is None:
            return
        if self.round_steps < 1:
            raise ConfigError(f"algorithm.update.round_steps must be >= 1 (or null: no rounds), got {self.round_steps}")
        if POLICY_LOSSES.needs(self.loss.name).rounds is None:
            with_rounds = [name for name in POLICY_LOSSES.names() if POLICY_LOSSES.needs(name).rounds is not None]
            raise ConfigError(
                f"algorithm.update.round_steps={self.round_steps} freezes pi_t for a round of an iterative method, but "
                f"loss '{self.loss.name}' reads pi_old as the sampling policy (losses with rounds: {', '.join(with_rounds)}); "
                "set algorithm.update.round_steps=null"
            )

    def _check_loss_requirements(self) -> None:
        """Refuse compositions the loss is undefined or unfaithful under (the Needs it declared at
        registration: required aggregation, one advantage per response)."""
        needs = POLICY_LOSSES.needs(self.loss.name)
        conflicts = " ".join(needs.conflicts)
        wanted = needs.aggregation
        if wanted and self.aggregation.name != wanted:
            raise ConfigError(
                f"loss '{self.loss.name}' needs algorithm/aggregation={wanted}, got '{self.aggregation.name}' ({conflicts})"
            )
        if needs.advantage_level == "sequence" and ADVANTAGES.needs(self.advantage.name).token_level_advantage:
            raise ConfigError(
                f"loss '{self.loss.name}' needs one advantage per response, but advantage '{self.advantage.name}' "
                f"is token-level ({conflicts})"
            )

    @property
    def on_policy_requirements(self) -> list[str]:
        """Each piece of the composition that declared it needs on-policy data (registry.Needs.on_policy),
        as "<kind> '<name>': <why>"."""
        pieces = (("advantage", ADVANTAGES, self.advantage.name), ("loss", POLICY_LOSSES, self.loss.name))
        return [f"{kind} '{name}': {registry.needs(name).on_policy}" for kind, registry, name in pieces
                if registry.needs(name).on_policy]

    @property
    def updates_per_batch(self) -> int:
        """Policy updates one batch is trained for: epochs x minibatches (standard); K + 1 passes of those
        (sfpo: K fast passes and the slow one); 1 (trpo: one natural-gradient step); 0 (none). Only the
        first of them sees pi_theta = pi_old on the freshly sampled tokens."""
        if self.schedule == "none":
            return 0
        if self.schedule == "trpo":
            return 1
        passes = self.schedule_settings.fast_steps + 1 if self.schedule == "sfpo" else 1
        return passes * self.epochs * self.minibatches

    @property
    def group_relative(self) -> bool:
        """True when the advantage estimator compares responses of the same prompt."""
        return "group_index" in inspect.signature(ADVANTAGES.get(self.advantage.name)).parameters

    @property
    def uses_optimizer(self) -> bool:
        """False under trpo, which sets the parameters by its own line search, and under none, which
        changes no parameter: the optimizer and its learning-rate schedule play no part."""
        return self.schedule not in ("trpo", "none")

    @property
    def needs_reference(self) -> bool:
        """A frozen reference model is loaded only when the KL term is active (in the loss or the reward) or
        the policy loss reads pi_ref itself (dpo, ipo) or RTO's dense reward does (log pi_dpo - log pi_ref) or
        OPRL's implicit PRM does (beta (log pi_phi - log pi_ref), algorithm.online_prm.baseline=reference)."""
        return (self.kl_coef > 0 or self.rto is not None or self.online_prm == "reference"
                or "ref_logp" in POLICY_LOSSES.accepted_inputs(self.loss.name))

    @property
    def loss_has_stages(self) -> bool:
        """The policy loss trains in stages of reference (it reads ``reference_stage``: SACPO): its second stage
        starts at algorithm.reincarnate_at, against the policy as it is then, with a fresh optimizer state."""
        return "reference_stage" in POLICY_LOSSES.accepted_inputs(self.loss.name)

    @property
    def loss_reads_whole_groups(self) -> bool:
        """The policy loss compares a group's responses with each other (registry.Needs.whole_groups): the
        update keeps every group in one micro-batch and one mini-batch."""
        return POLICY_LOSSES.needs(self.loss.name).whole_groups is not None

    @property
    def kl_in_loss(self) -> bool:
        return self.kl_coef > 0 and self.kl_placement == "loss"

    @property
    def kl_in_reward(self) -> bool:
        return self.kl_coef > 0 and self.kl_placement == "reward"

    @property
    def kl_estimator_params(self) -> dict[str, float]:
        """The YAML knobs of the KL estimator (today only k3's and k3+'s ``clamp``)."""
        return {} if self.kl_clamp is None else {"clamp": self.kl_clamp}

    def kl_matrix(self, logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
        """The configured per-token KL estimate k(logp, ref_logp) [B,T] (unmasked)."""
        return KL_ESTIMATORS.call(self.kl_estimator, {"logp": logp, "ref_logp": ref_logp}, self.kl_estimator_params)

    def loss_kl_matrix(self, logp: torch.Tensor, ref_logp: torch.Tensor, prev_logp: torch.Tensor | None,
                       kl_scale: torch.Tensor | None = None) -> torch.Tensor:
        """The loss's KL term per token: k(logp, ref_logp), or with ``kl.previous_weight`` w > 0 ReMix's
        KL-Convex constraint (Liang et al. 2025, arXiv:2507.06892, section 3.2)

            (1 - w) k(logp, ref_logp) + w k(logp, prev_logp)

        where prev_logp are the log-probs of the policy before this step's update (the sampling pass); with
        ``kl.difficulty_scale`` each response's row times its factor s_i (``kl_scale`` [B], CLPO's dynamic KL,
        rlbench.algorithm.kl.difficulty_kl_scale). Without it (None) nothing is multiplied."""
        w = self.kl_previous_weight
        if w == 0:
            matrix = self.kl_matrix(logp, ref_logp)
        elif prev_logp is None:
            raise ValueError("algorithm.kl.previous_weight > 0 needs the previous policy's log-probs (prev_logp)")
        else:
            matrix = (1 - w) * self.kl_matrix(logp, ref_logp) + w * self.kl_matrix(logp, prev_logp)
        if self.kl_difficulty_scale is None:
            return matrix
        if kl_scale is None:
            raise ValueError("algorithm.kl.difficulty_scale needs each response's factor (kl_scale)")
        return matrix * kl_scale.to(matrix.dtype).unsqueeze(-1)

    @property
    def kl_coefficient(self) -> float:
        """beta now: algorithm.kl.coef, or where the adaptive controller has moved it."""
        return self.coefficients.kl

    @property
    def entropy_coefficient(self) -> float:
        """The entropy-bonus coefficient applied now (fixed, or adaptive and possibly gated off)."""
        if self.entropy_adaptive is None:
            return self.coefficients.entropy
        return self.entropy_adaptive.applied(self.coefficients.entropy, self.coefficients.last_entropy)

    @property
    def uses_entropy_bonus(self) -> bool:
        """True when the loss may contain an entropy bonus, so its entropy needs a gradient."""
        return self.entropy_coef > 0 or self.entropy_adaptive is not None

    @property
    def needs_sampling_pass(self) -> bool:
        """A no-grad pass over the sampled batch (old log-probs, entropies) before the advantage; the
        old log-probs alone do not need it under bypass (they are the rollout engine's)."""
        reads_old_logp = any((  # under rounds the loss's pi_old is the round's frozen copy (training/rounds.py)
            self.advantage_inputs & {"old_logp"}, self.needs_old_logp and self.round_steps is None, self.kl_in_reward,
            self.kl_adaptive is not None,
        ))
        return any((
            reads_old_logp and not self.bypasses_old_logp, self.advantage_inputs & {"entropy", "values", "sum_pi_squared"},
            self.needs_sampling_entropy, self.kl_previous_weight > 0,
        ))

    @property
    def bypasses_old_logp(self) -> bool:
        """algorithm.sampling_correction.bypass: pi_old is the rollout engine's log-probs, never recomputed."""
        return self.sampling_correction is not None and self.sampling_correction.bypass

    @property
    def needs_sampling_entropy(self) -> bool:
        return any(("entropy" in self.advantage_inputs, self.top_entropy_quantile is not None,
                    self.downsampling is not None and self.downsampling.masks_tokens))

    @property
    def needs_sampling_sum_pi_squared(self) -> bool:
        """The sampling pass also sums the squared probabilities of each token's distribution (an advantage
        that reads ``sum_pi_squared``: the optimal token baseline)."""
        return "sum_pi_squared" in self.advantage_inputs

    @property
    def needs_old_logp(self) -> bool:
        """Stored old log-probs are needed only when a batch is reused for several updates (epochs,
        minibatches, or a schedule other than standard), or when the sampling correction drops
        rejected tokens (decided on these log-probs before the update)."""
        return self.epochs > 1 or self.minibatches > 1 or self.schedule != "standard" or self.drops_rejected_tokens

    @property
    def drops_rejected_tokens(self) -> bool:
        """algorithm.sampling_correction.rejected_tokens=drop: the trainer removes them from the mask."""
        return self.sampling_correction is not None and self.sampling_correction.drops_rejected

    @property
    def needs_vocabulary_log_probs(self) -> bool:
        """The forward keeps the full-vocabulary log-probs only for a loss that reads them (otr)."""
        return "log_probs" in POLICY_LOSSES.accepted_inputs(self.loss.name)

    @property
    def needs_proximal_policy(self) -> bool:
        """An EWMA copy of the weights is kept only for a loss that reads prox_logp (ppo_ewma)."""
        return "prox_logp" in POLICY_LOSSES.accepted_inputs(self.loss.name)

    @property
    def advantage_inputs(self) -> set[str]:
        """The inputs the step computes before the advantage (beyond rewards, groups, mask) that the
        estimator reads: old log-probs, entropies, values, verdicts, the budget, token rewards."""
        computed = {e.name for e in STEP_INPUTS.read_by("advantage") if e.producer in STEP_COMPUTED_PRODUCERS}
        return ADVANTAGES.accepted_inputs(self.advantage.name) & computed

    def prompt_instruction(self, problem: Any) -> str | None:
        """The sentence the reward shaping writes after ``problem``'s text in its prompt, or None: INTELLECT-2's
        length target with length_target's ``prompt`` set (the target of length_target_instruction, the one
        its reward reads)."""
        for shaper in self.reward_shaping:
            if shaper.name == "length_target" and shaper.params.get("prompt"):
                params = shaper.params
                return length_target_instruction(problem.uid, params["prompt"], params.get("targets"), params.get("seed", 0))
        return None

    def shape_rewards(self, rewards: torch.Tensor, inputs: Mapping[str, Any]) -> torch.Tensor:
        """The reward after the algorithm's reward shaping ([B]; ``rewards`` itself without any).
        ``inputs``: the trainer's shaping inputs (rlbench/algorithm/shaping.py)."""
        if not self.reward_shaping:
            return rewards
        return apply_shaping(rewards, [(s.name, s.params) for s in self.reward_shaping], inputs)

    def kl_reward_terms(
        self, rewards: torch.Tensor, response_mask: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(rewards for the advantage, token rewards or None, per-response KL [B]) for this batch.

        The per-response KL sum_t k(old_logp, ref_logp) is what the adaptive controller observes.
        With kl.placement=reward the rewards carry -beta sum_t k_t (``kl_penalised_rewards``) and
        estimators with a ``token_rewards`` input get the per-token form; otherwise the rewards pass
        through unchanged."""
        mask = response_mask.to(old_logp.dtype)
        kl_matrix = self.kl_matrix(old_logp, ref_logp) * mask
        per_response = sequence_kl(kl_matrix, mask)
        if not self.kl_in_reward:
            return rewards, None, per_response
        penalised, token_rewards = kl_penalised_rewards(rewards, kl_matrix, mask, self.kl_coefficient)
        token_level = "token_rewards" in self.advantage_inputs
        return penalised.to(rewards.dtype), token_rewards if token_level else None, per_response

    def rto_reward_terms(
        self, rewards: torch.Tensor, response_mask: torch.Tensor, old_logp: torch.Tensor | None, ref_logp: torch.Tensor,
        dpo_logp: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """RTO's (sequence rewards, token rewards, per-response KL) (arXiv:2404.18922 sec. 4, ``rto_rewards``):
        r_t = beta_dpo (log pi_dpo - log pi_ref) - beta_KL k(old, ref) + 1[t = T] sparse_coef R. Without old
        log-probs (no sampling pass: the KL is off and nothing else reads them) the KL terms are 0."""
        mask = response_mask.to(ref_logp.dtype)
        kl_matrix = torch.zeros_like(mask) if old_logp is None else self.kl_matrix(old_logp, ref_logp) * mask
        kl_coef = self.kl_coefficient if self.kl_in_reward else 0.0
        total, token_rewards = rto_rewards(rewards, response_mask, dpo_logp, ref_logp, self.rto.beta_dpo,
                                           self.rto.sparse_coef, kl_matrix, kl_coef, self.rto.dpo_clip)
        return total.to(rewards.dtype), token_rewards, sequence_kl(kl_matrix, mask)

    def token_weights(self, entropy: torch.Tensor | None, response_mask: torch.Tensor) -> torch.Tensor | None:
        """The policy-loss token mask [B,T] for this batch, or None (no masking)."""
        if self.top_entropy_quantile is None:
            return None
        if entropy is None:
            raise ValueError("the top-entropy token mask needs the sampling policy's entropies")
        return top_entropy_token_mask(entropy, response_mask, self.top_entropy_quantile)

    def update_coefficients(self, observed_kl: float | None, observed_entropy: float | None, n_steps: int) -> None:
        """After a step: move the adaptive coefficients from this step's KL and entropy."""
        state = self.coefficients
        if self.kl_adaptive is not None and observed_kl is not None:
            state.kl = self.kl_adaptive.next_coefficient(state.kl, observed_kl, n_steps)
        if self.entropy_adaptive is not None and observed_entropy is not None:
            state.entropy = self.entropy_adaptive.next_coefficient(state.entropy, observed_entropy)
            state.last_entropy = observed_entropy

    def compute_advantages(
        self, rewards: torch.Tensor, group_index: torch.Tensor, response_mask: torch.Tensor, **extra: Any
    ) -> torch.Tensor:
        """``extra`` holds optional inputs (entropy, old_logp, ...) for estimators that read them."""
        inputs = {"rewards": rewards, "group_index": group_index, "response_mask": response_mask}
        inputs.update({k: v for k, v in extra.items() if v is not None})
        return ADVANTAGES.call(self.advantage.name, inputs, self.advantage.params)

    def aggregate(self, matrix: torch.Tensor, response_mask: torch.Tensor, norms: Mapping[str, int]) -> torch.Tensor:
        inputs = {"loss_matrix": matrix, "response_mask": response_mask, **norms}
        return AGGREGATIONS.call(self.aggregation.name, inputs, self.aggregation.params)

    def positive_nll(
        self, logp: torch.Tensor, mask: torch.Tensor, correct: torch.Tensor | None, norms: Mapping[str, int]
    ) -> torch.Tensor:
        """The negative log-likelihood of the correct responses C, aggregated like the loss over their tokens:

            L_NLL = aggregate_C(-log pi_theta(o_it | q, o_i,<t)),   C = {i : correct_i}

        with the configured aggregation normalised by C's counts in the optimizer batch (``norms``' correct_*,
        rlbench.training.batch.batch_norms); under token_mean L_NLL = sum_{i in C} sum_t m_it (-log pi_it) /
        N_tok(C), 0 when C is empty. The authors' release of CE-GPPO (Su et al. 2025, arXiv:2509.20712;
        Kwai-Klear/CE-GPPO, verl/workers/actor/dp_actor.py, positive_loss_coeff=0.1 in every script) adds
        0.1 L_NLL to the policy loss with C the responses whose reward equals the correct score (their
        grader's verdict) and the actor's token-mean over C's tokens in each micro-batch (verl normalises
        by the micro-batch, rlbench by the optimizer batch, as for every term). Incorrect responses get no
        gradient from it."""
        if correct is None:
            raise ValueError("algorithm.positive_nll_coef > 0 needs the grader's verdicts (the step input correct)")
        target = correct.to(mask.dtype)[:, None] * mask
        counts = {key: norms[f"correct_{key}"] for key in ("batch_tokens", "batch_sequences", "batch_groups")}
        return self.aggregate(target_nll(logp, target), target, {**norms, **counts})

    def compute_loss(self, *, norms: Mapping[str, int], **step_inputs: Any) -> tuple[torch.Tensor, dict[str, float]]:
        """The scalar loss of one (micro-)batch and its metrics.

        ``step_inputs``: the loss step's inputs by name, each an entry of STEP_INPUTS read by the
        policy loss or the composition's own terms (readers ``loss`` and ``objective``); logp, old_logp,
        advantages and response_mask are required, the others may be absent or None.
        ``norms`` carries the optimizer batch's counts (batch_tokens, batch_sequences, norm_length)
        so that micro-batch losses add up to the full-batch loss. ``token_weights`` (e.g. the
        top-entropy mask) multiplies the policy-loss matrix only, before aggregation. With a critic,
        ``values`` (with gradient), ``old_values`` (the sampling policy's) and ``returns`` give the
        value loss. ``sampling_logp`` (the rollout engine's log-probs of the sampled tokens, [B,T])
        weights the policy-loss matrix by truncated importance weights when
        algorithm.sampling_correction is set (sampling_correction.py); without it, or with
        sampling_logp=None (the HF engine: sampler = trainer), nothing changes.
        """
        unknown = set(step_inputs) - STEP_INPUTS.names("loss", "objective")
        if unknown:
            raise TypeError(f"compute_loss got {sorted(unknown)}, which are not loss step inputs (rlbench/algorithm/step_inputs.py)")
        given = {name: value for name, value in step_inputs.items() if value is not None}
        logp, old_logp, response_mask = given["logp"], given["old_logp"], given["response_mask"]
        entropy, ref_logp, sampling_logp = given.get("entropy"), given.get("ref_logp"), given.get("sampling_logp")
        values, returns = given.get("values"), given.get("returns")
        mask = response_mask.to(logp.dtype)
        # the policy loss's inputs: its registry's entries, with the mask as float, entropy and prox_logp
        # without gradient, and the off-policy mask as zeros when every token is on-policy (no branch in a piece)
        inputs = {name: value for name, value in given.items() if name in POLICY_LOSSES.inputs}
        inputs.update(response_mask=mask, progress=given.get("progress", 0.0))
        inputs.update({name: given[name].detach() for name in ("entropy", "prox_logp") if name in given})
        inputs["off_policy"] = given.get("off_policy", torch.zeros_like(mask))
        loss_matrix, metrics = POLICY_LOSSES.call(self.loss.name, inputs, self.loss.params)
        token_weights = given.get("token_weights")
        if token_weights is not None:
            loss_matrix = loss_matrix * token_weights
        metrics = dict(metrics)
        if self.sampling_correction is not None:
            sampler_weights = self.sampling_correction.weights(old_logp, sampling_logp, mask)
            if sampler_weights is not None:
                metrics["sampling_weight_mean"] = masked_mean(sampler_weights, mask).item()
                metrics.update(self.sampling_correction.metrics(sampler_weights, mask))
                loss_matrix = loss_matrix * self.sampling_correction.normalized(sampler_weights, mask)
        policy_loss = self.aggregate(loss_matrix, mask, norms)
        total = policy_loss
        metrics["policy_loss"] = policy_loss.item()
        if self.kl_in_loss:
            if ref_logp is None:
                raise ValueError("the KL term needs reference log-probs")
            kl_matrix = self.loss_kl_matrix(logp, ref_logp, given.get("prev_logp"), given.get("kl_scale")) * mask
            kl_value = self.aggregate(kl_matrix, mask, norms)
            total = total + self.kl_coefficient * kl_value
            metrics["kl"] = kl_value.item()
        entropy_coef = self.entropy_coefficient
        if entropy_coef > 0:
            if entropy is None:
                raise ValueError("the entropy bonus needs per-token entropies")
            entropy_value = self.aggregate(entropy * mask, mask, norms)
            total = total - entropy_coef * entropy_value
        if self.positive_nll_coef > 0:
            nll_value = self.positive_nll(logp, mask, given.get("correct"), norms)
            total = total + self.positive_nll_coef * nll_value
            metrics["positive_nll"] = nll_value.item()
        if self.critic is not None:
            if values is None or returns is None:
                raise ValueError("the critic term needs values (value head) and returns")
            old = given.get("old_values", values.detach())
            value_value = self.aggregate(value_loss(values, old, returns, mask, self.critic.clip), mask, norms)
            total = total + self.critic.coef * value_value
            metrics["value_loss"] = value_value.item()
        return total, metrics
