"""Typed schemas of the composed run configuration: one dataclass per node, a help string per field.

The schemas say which keys exist, their types, their ranges and what they do. They are not merged
into the config by Hydra (the YAML under conf/ stays the source of values); ``rlbench.config.walk``
checks a composed config against them, so that a misspelt or misplaced key, added by a YAML file or
by ``+``/``++`` on the command line, is refused before anything is loaded.

The schema imports nothing from the packages it describes: the names a registry holds (rollout
strategies, prompt samplers, algorithm pieces) are passed to the walk by the run layer
(``rlbench.validation``), so this module sits at the bottom of the layers beside ``rlbench.errors``.

Field metadata:
  help          what the knob does (``rlbench-list`` prints it)
  ge, gt, le    numeric bounds (``ge=0``: the value must be >= 0)
  only_with     (selector, value): the block holds the settings of one choice of its sibling key
                ``selector`` (algorithm.update.trpo only with schedule=trpo) and is refused otherwise
  piece         the node is ``{name, <parameters>}`` of a registered piece of this kind
                (advantage, loss, aggregation, reward_shaping); its parameters are checked against
                the function's signature at run time, so a new piece needs no schema edit
  settings_blocks  the key names a registered choice, and each choice may have a block of settings
                beside it named after it (``rollout.<strategy>``, ``trainer.prompt_sampler.<name>``), allowed only
                with that choice; the choice's own options class checks the block's keys
  derived       not a config key: filled by the conversion to these dataclasses (rlbench/config/typed.py),
                e.g. the settings blocks of a settings_blocks choice
  open          a mapping whose keys are free (paper metadata, dataset field maps, LlamaConfig fields)
  typed_keys    with open: {key: schema} for the keys of the free mapping that are schema nodes all the same
                (paper.fidelity)
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Literal, Optional


def knob(default: Any = None, help: str = "", **metadata: Any) -> Any:
    """A schema field: its default (``MISSING`` for a required key), help string and checks."""
    if isinstance(default, (list, dict)):
        value = default
        return field(default_factory=lambda: type(value)(value), metadata={"help": help, **metadata})
    if default is MISSING:
        return field(metadata={"help": help, **metadata})
    return field(default=default, metadata={"help": help, **metadata})


def config_fields(schema: type) -> list[Any]:
    """The fields of ``schema`` that are config keys (not the ``derived`` ones)."""
    return [spec for spec in fields(schema) if not spec.metadata.get("derived")]


def node(cls: type, help: str = "", **metadata: Any) -> Any:
    """A nested schema node (its fields are checked one level down)."""
    return field(default=None, metadata={"help": help, "node": cls, **metadata})


# ----------------------------------------------------------------------------------------- algorithm


@dataclass
class AdaptiveKLConfig:
    """Ziegler et al. 2019 (arXiv:1909.08593): beta <- beta (1 + clip(KL/target - 1, +-0.2) B/horizon)."""

    target: float = knob(None, "KL (per response, summed over tokens) the controller steers towards; the paper uses 6")
    horizon: float = knob(None, "responses over which the coefficient may move by e; the paper uses 10000")


@dataclass
class KLDifficultyScaleConfig:
    """CLPO's difficulty-aware KL (arXiv:2509.25004 v1; rlbench.algorithm.kl.difficulty_kl_scale): the loss's KL term
    of a response times its curriculum label's factor (labels: prompt_sampler=clpo)."""

    hard: float = knob(1.0, "s of hard responses (the release: 0.5)", ge=0)
    medium: float = knob(1.0, "s of medium responses", ge=0)
    easy: float = knob(1.0, "s of easy responses", ge=0)


@dataclass
class KLConfig:
    """The KL term between the policy and a frozen reference model."""

    coef: float = knob(0.0, "beta; > 0 loads a frozen reference model", ge=0)
    estimator: str = knob("k3", "registered KL estimator (rlbench-list shows them): k1 | k2 | k3 ...", registry="kl_estimator")
    clamp: Optional[float] = knob(None, "c > 0: clamp the value of k3 / k3+ to [-c, c] (verl's low_var_kl: 10); null: no clamp")
    placement: Literal["loss", "reward"] = knob(
        "loss", "loss: beta * KL added to the loss; reward: beta * KL subtracted from the reward (per token for token-level estimators)"
    )
    adaptive: Optional[AdaptiveKLConfig] = node(
        AdaptiveKLConfig, "null: beta fixed; {target, horizon}: Ziegler et al.'s adaptive controller (needs coef > 0)"
    )
    previous_weight: float = knob(
        0.0, "w in [0, 1]: the loss's KL is (1 - w) KL(pi || pi_ref) + w KL(pi || pi_prev), pi_prev = the policy "
        "before this step's update (ReMix's KL-Convex, lambda = 1 - w); 0: the reference only", ge=0
    )
    difficulty_scale: Optional[KLDifficultyScaleConfig] = node(
        KLDifficultyScaleConfig, "null (or every factor 1): the plain KL term; {hard: 0.5}: the loss's KL of each response "
        "times its curriculum difficulty label's factor (CLPO's dynamic KL; the labels: prompt_sampler=clpo)"
    )


@dataclass
class AdaptiveEntropyConfig:
    """Adaptive entropy coefficient (Skywork-OR1, arXiv:2505.22312; TRL's form)."""

    target: float = knob(None, "mean token entropy the coefficient steers towards (required)")
    delta: float = knob(0.005, "step of the coefficient after each training step")
    min_coef: float = knob(0.0, "lower bound of the coefficient")
    max_coef: float = knob(1.0, "upper bound of the coefficient")
    gate: bool = knob(False, "true: apply the bonus only while the last entropy is at or below the target")


@dataclass
class TokenMaskConfig:
    """Which tokens get a policy gradient (Wang et al. 2025, arXiv:2506.01939, eq. 6)."""

    top_entropy_quantile: Optional[float] = knob(
        None, "null: every token; q in (0, 1]: only the top-q fraction of the batch's tokens by entropy"
    )


@dataclass
class SamplingCorrectionConfig:
    """Truncated importance sampling between the rollout engine and the trainer (Yao et al. 2025, TIS)."""

    cap: float = knob(2.0, "truncate: each token's loss weight is min(pi_old / pi_sampler, cap); mask / reject: the upper bound of the kept ratios")
    mode: str = knob(
        "truncate", "truncate (TIS) | mask: weight rho inside [low, cap], 0 outside | reject: weight 1 inside, 0 outside | "
        "verl's rollout_rs modes token_k2, seq_sum_k1, seq_max_k3, ... (the list: sampling_correction.MODES)"
    )
    low: Optional[float] = knob(None, "mask / reject: the lower bound of the kept ratios; null: 1 / cap", ge=0)
    rejected_tokens: Literal["zero_weight", "drop"] = knob(
        "zero_weight", "mask / reject: zero_weight: a rejected token weighs 0 and stays in the token count | "
        "drop: it leaves the response mask before the advantage, so aggregations count only the kept tokens (verl)"
    )
    level: Literal["token", "sequence"] = knob(
        "token", "truncate: token: one weight per token | sequence: one per response, min(exp(sum of its log-ratios), cap) (verl)"
    )
    normalize: bool = knob(False, "truncate: divide the weights by their batch mean so they average 1, over the valid tokens "
                           "(level token) or the responses (level sequence) (verl's rollout_is_batch_normalize)")
    bypass: bool = knob(False, "pi_old is the rollout engine's log-probs: the trainer does not recompute it "
                        "(verl's rollout_correction.bypass_mode); the weights are then 1, so only with the defaults of the other keys")
    threshold: Optional[float] = knob(None, "k2 / k3 rejection modes: the largest divergence kept (verl's rollout_rs_threshold)", ge=0)


@dataclass
class DownSamplingConfig:
    """D3S, dynamic dual-level down-sampling (Wang et al. 2025, arXiv:2509.22115; rlbench/algorithm/downsampling.py)."""

    samples: float = knob(0.5, "f_0 in (0, 1]: keep ceil(f_t n) responses per group, the extremes of the advantages (max Var(A))", gt=0, le=1)
    tokens: float = knob(0.5, "q_0 in (0, 1]: of the kept responses' tokens, train the top q_t fraction by |A| H", gt=0, le=1)
    schedule: Literal["linear", "cosine"] = knob("linear", "how f_t and q_t rise with the training progress to 1")
    horizon: float = knob(1.0, "the progress in (0, 1] at which f_t = q_t = 1 (the base algorithm from then on)", gt=0, le=1)
    scope: Literal["group", "batch"] = knob("group", "group: a subset of each prompt's group (intra-group); batch: of the whole batch (cross-group)")


@dataclass
class PolicyFiltrationConfig:
    """PF-PPO's policy filtration (Zhang et al. 2024, arXiv:2409.06957, sec. 4; verl algorithm.pf_ppo): the trained
    batch re-sampled by reward after the advantages (rlbench/algorithm/advantages/verl_pieces.py)."""

    method: Literal["pow", "max_min", "max_random"] = knob(
        "pow", "pow: weights |r|^weight_pow; max_min: only the batch's best and worst rewards; max_random: 0.4 for the best, 0.1 else")
    weight_pow: float = knob(2.0, "the exponent of method pow", ge=0)


@dataclass
class RTOConfig:
    """RTO (Zhong et al. 2024, arXiv:2404.18922, sec. 4): a frozen DPO model's token reward beta_dpo (log pi_dpo -
    log pi_ref) on every response token, plus sparse_coef R on the last (rlbench/algorithm/rto.py); beta_KL is
    algorithm.kl.coef with kl.placement=reward."""

    dpo_model: Optional[str] = knob(None, "required: the Hugging Face folder of pi_dpo, a DPO model of the policy's architecture "
                                    "and tokenizer (the policy/ folder of an algorithm=dpo run with trainer.save_model=true)")
    beta_dpo: float = knob(0.1, "beta_1: weight of the dense DPO token reward log pi_dpo - log pi_ref (0: PPO's sparse reward)", ge=0)
    sparse_coef: float = knob(1.0, "beta_2: weight of the run's verifier reward R on the last response token", ge=0)
    dpo_clip: float = knob(0.0, "c > 0: clamp each token's DPO reward to [-c, c] (the authors' release: 0.05); 0: no clamp", ge=0)


@dataclass
class QRPOConfig:
    """QRPO's reference set (Matrenok et al. 2025, arXiv:2507.08068, sec. 3; rlbench/training/reference_rewards.py):
    K responses of pi_ref per prompt, graded by the run's reward, whose rewards give each trained response its
    quantile (loss qrpo)."""

    reference_samples: int = knob(0, "K responses of pi_ref per prompt, sampled once (each prompt with its own seed), "
                                  "graded by the run's reward and cached; 0: the response's group is its reference set", ge=0)
    reference_cache: Optional[str] = knob(None, "a JSON file keeping the K rewards per prompt across runs (entries of "
                                          "another reference, K, sampling or reward are resampled); null: "
                                          "<run folder>/reference_rewards.json, which a resumed run reads")


@dataclass
class OnlinePRMConfig:
    """OPRL's implicit process reward model (Liu et al. 2025, arXiv:2509.19199, section 3; rlbench/training/online_prm.py):
    pi_phi, a copy of the initial policy trained online, alternating with the policy, by a trajectory-level DPO loss on
    the step's outcome-ranked pairs of a group; its step rewards beta (log pi_phi - log pi_base) feed advantage oprl,
    pi_base the ``baseline``."""

    beta: float = knob(0.05, "beta of the implicit reward beta (log pi_phi - log pi_ref) (the paper's range 0.05-0.1; "
                       "unverified default)", gt=0)
    lr: float = knob(1e-6, "the PRM's own AdamW learning rate (no weight decay)", gt=0)
    updates: int = knob(1, "optimizer steps of the PRM on each step's pairs, before the step's advantages", ge=1)
    baseline: str = knob("reference", "the policy log pi_phi is compared with: reference (the frozen initial policy "
                         "pi_ref) | policy (the policy that sampled the step, pi_theta_old, the paper's; no reference "
                         "model is loaded)")
    steps: str = knob("turns", "what a step k is: turns (the turns of rollout=multi_turn's episodes) | paragraphs "
                      "(a single-turn response cut at its blank lines, the paper's reasoning steps for math)")


@dataclass
class FittedModelConfig:
    """A model fitted apart from the policy before the actor trains, on rollout=offline's data set (a copy of pi_ref
    with a value head; rlbench/training/fitted_model.py)."""

    epochs: int = knob(2, "passes of the fit over its data set", ge=1)
    lr: float = knob(1e-4, "the fit's AdamW learning rate", gt=0)
    batch_size: int = knob(8, "items per mini-batch of the fit (responses of the critic, pairs of the preference "
                           "model) and responses per forward when it scores the batch", ge=1)
    path: Optional[str] = knob(None, "a file keeping the fitted model and its identity (reference weights, data, "
                               "settings, seed, sampling, reward); a run whose identity matches reads it instead of "
                               "fitting; null: a file in the run folder, which a resumed run reads")


@dataclass
class StepCriticConfig(FittedModelConfig):
    """Direct Advantage PO's critic (Liu et al. 2024, arXiv:2412.18279, section 3; rlbench/training/step_critic.py): a
    copy of pi_ref with a value head, fitted before the actor trains on Monte-Carlo values of the offline data's step
    states (vine's steps and estimates), then valuing every trained response's steps (file: step_critic.pt)."""

    epochs: int = knob(4, "passes of the critic's regression over the data set's states", ge=1)
    k: int = knob(4, "Monte-Carlo continuations of pi_ref per state (VinePPO's K; the paper's count is not read)", ge=1)
    boundary: str = knob("newline", "where a step ends: newline (after a token holding one) | tokens (every step_tokens)")
    step_tokens: int = knob(4, "tokens per step with boundary=tokens", ge=1)
    max_steps: int = knob(8, "at most this many steps per response (more boundaries are thinned evenly)", ge=1)


@dataclass
class PreferenceModelConfig(FittedModelConfig):
    """DRPO's learned preference model (Xu et al. 2025, arXiv:2506.01183, section 4; rlbench/training/preference_model.py):
    a copy of pi_ref with a value head, fitted before the actor by the Bradley-Terry likelihood on the offline data
    set's labelled pairs; the dr_preference loss reads its preferences sigma(r_a - r_b) (file: preference_model.pt)."""


@dataclass
class SFPOConfig:
    """Slow-Fast Policy Optimization settings (arXiv:2510.04072); used with schedule=sfpo."""

    fast_steps: int = knob(3, "K fast passes over the batch before repositioning")
    alpha: float = knob(0.8, "reposition theta~ = theta_0 + alpha (theta_K - theta_0)")
    entropy_window: int = knob(30, "steps of entropy history the z-score is computed over")
    entropy_z: Optional[float] = knob(1.0, "z-score at which SFPO switches off for good; null: never")


@dataclass
class TRPOConfig:
    """Trust Region Policy Optimization settings (arXiv:1502.05477); used with schedule=trpo."""

    max_kl: float = knob(0.01, "delta: bound on the token-mean KL(pi_old || pi_new)")
    cg_iters: int = knob(10, "conjugate-gradient iterations for F^-1 g")
    damping: float = knob(0.1, "F + damping I keeps CG well posed")
    backtrack: float = knob(0.8, "line-search step factor backtrack^j")
    line_search_steps: int = knob(10, "line-search tries at most")


@dataclass
class ReferenceSoupConfig:
    """SALSA (arXiv:2411.01798): the KL reference is a weight soup of fine-tuned checkpoints, or of policy snapshots (rlbench/training/reference_soup.py)."""

    models: int = knob(2, "ingredients of the soup: the initial policy and models - 1 snapshots of the policy (1: the plain reference)", ge=1)
    every: int = knob(1, "policy updates between two snapshots added to the soup", ge=1)
    checkpoints: list = knob(
        [], "SALSA's ingredients: fine-tuned checkpoints (Hugging Face folders of the policy's architecture, e.g. two runs' "
        "policy/ folders) whose parameter average is the KL reference, fixed for the run; empty: the stand-in, the "
        "initial policy and snapshots of the policy (models, every)")


@dataclass
class UpdateConfig:
    """How one rollout batch's loss becomes parameter changes (rlbench/algorithm/schedules.py)."""

    schedule: Literal["standard", "sfpo", "trpo", "none"] = knob(
        "standard", "standard: epochs x minibatches optimizer steps; sfpo: slow-fast; trpo: one natural-gradient step; none: no parameter update (training_free_grpo)"
    )
    epochs: int = knob(1, "passes over each rollout batch", ge=1)
    minibatches: int = knob(1, "optimizer steps per pass; > 1 (or epochs > 1) stores old log-probs", ge=1)
    proximal_decay: Optional[float] = knob(
        None, "EWMA decay of the proximal policy of decoupled PPO (loss ppo_ewma only); null: 0"
    )
    round_steps: Optional[int] = knob(
        None, "iterative rounds (INPO, REBEL): the loss's pi_t is a frozen copy of the policy taken every round_steps "
        "steps (rlbench/training/rounds.py); null: pi_t is each step's sampling policy", ge=1
    )
    round_sampling: Literal["pi_t", "policy"] = knob(
        "pi_t", "with round_steps: who samples a round's batches: pi_t, the round's frozen copy (INPO's and REBEL's "
        "Algorithm 1: sample with pi_t, then fit), or the training policy (each batch from the latest weights)"
    )
    sfpo: Optional[SFPOConfig] = node(SFPOConfig, "settings of schedule=sfpo (only with it)", only_with=("schedule", "sfpo"))
    trpo: Optional[TRPOConfig] = node(TRPOConfig, "settings of schedule=trpo (only with it)", only_with=("schedule", "trpo"))


@dataclass
class CriticConfig:
    """PPO's critic (arXiv:1707.06347, section 5): a value head on the policy, or a separate value model."""

    coef: float = knob(0.5, "weight of the clipped value loss")
    clip: Optional[float] = knob(0.2, "value clip range; null: no clipping")
    model: Literal["shared", "separate"] = knob(
        "shared", "shared: a value head on the policy's backbone, trained by the policy's optimizer; separate: a copy of "
        "the initial policy with a value head (verl's, OpenRLHF's critic), its own AdamW at critic.lr")
    lr: Optional[float] = knob(None, "the separate critic's AdamW learning rate (null: trainer.lr); model=separate only", gt=0)


@dataclass
class BaselineConfig:
    """Where baseline_rewards come from (ReMax arXiv:2310.10505, PVPO arXiv:2508.21104)."""

    source: Optional[str] = knob(None, "greedy | reference (null: the estimator's default)")
    samples: int = knob(8, "reference-policy samples per prompt")
    refresh_every: Optional[int] = knob(None, "steps between recomputing cached baselines; null: never")
    presample: bool = knob(False, "reference only: before step 1, estimate every training problem's baseline, drop "
                           "the problems the reference solves in every sample (PVPO's pre-sampling)")


@dataclass
class TrackerConfig:
    """SPO's per-prompt Beta tracker of the success probability (arXiv:2509.13232)."""

    rho: Optional[float] = knob(None, "fixed decay; null: adaptive between rho_min and rho_max")
    rho_min: float = knob(0.875, "lower bound of the adaptive decay")
    rho_max: float = knob(0.96, "upper bound of the adaptive decay")
    d_half: float = knob(0.06, "KL distance at which the decay is halfway")


@dataclass
class FidelityConfig:
    """How much of its method a preset builds (docs/papers.md, "Fidelity"): the same block on a paper preset
    (``paper.fidelity``) and on the algorithm, rollout and prompt-sampler presets named after a method
    (``algorithm.fidelity``, ``rollout.fidelity``, ``trainer.prompt_sampler.fidelity``). A run that composes a
    partial or adapted preset says so in one line at start-up (rlbench.validation.notice_fidelity)."""

    status: Literal["faithful", "partial", "adapted"] = knob(
        None, "faithful: every mechanism that defines the method is built and active (model, data and size "
        "substitutions are deviations) | partial: part of it is missing or replaced by a stand-in | adapted: the "
        "mechanism is complete, the paper's setting (domain, modality, tool environment) is replaced")
    missing: Optional[str] = knob(None, "status partial: what part of the mechanism is not built and what runs instead")
    adapted: Optional[str] = knob(None, "status adapted: how the method was carried to another setting than the paper's")
    method: Optional[str] = knob(None, "the method's name in the start-up line (null: the preset's name)")


@dataclass
class AlgorithmConfig:
    """``algorithm``: advantage x loss x aggregation x KL x entropy x update schedule (composition.py)."""

    name: str = knob("custom", "the preset's name (run names and tables)")
    paper: Optional[str] = knob(None, "citation of the method's paper (arXiv id)")
    advantage: Any = knob(None, "advantage estimator {name, parameters} (algorithm/advantage=<option>)", piece="advantage")
    loss: Any = knob(None, "policy loss {name, parameters} (algorithm/loss=<option>)", piece="loss")
    aggregation: Any = knob(None, "loss aggregation {name} (algorithm/aggregation=<option>)", piece="aggregation")
    kl: KLConfig = node(KLConfig, "KL to a reference model")
    reference_soup: Optional[ReferenceSoupConfig] = node(
        ReferenceSoupConfig, "null: the reference is the initial policy; {models, every}: a weight soup of policy snapshots (SALSA)"
    )
    entropy_coef: float = knob(0.0, "entropy-bonus coefficient (the start value when entropy_adaptive is set)", ge=0)
    entropy_adaptive: Optional[AdaptiveEntropyConfig] = node(AdaptiveEntropyConfig, "null: fixed entropy_coef; {target, ...}: adaptive")
    positive_nll_coef: float = knob(0.0, "weight of the negative log-likelihood of the correct responses added to the loss, "
                                    "aggregated like the loss over their tokens (CE-GPPO's released scripts: 0.1); 0: off", ge=0)
    token_mask: TokenMaskConfig = node(TokenMaskConfig, "which tokens get a policy gradient")
    sampling_correction: Optional[SamplingCorrectionConfig] = node(
        SamplingCorrectionConfig, "null: none; {cap, mode, low, rejected_tokens, level, normalize}: truncated / masked importance sampling or per-token rejection between sampler and trainer"
    )
    downsampling: Optional[DownSamplingConfig] = node(
        DownSamplingConfig, "null: off; {samples, tokens, schedule, horizon, scope}: D3S's annealed sample and token down-sampling"
    )
    pf_ppo: Optional[PolicyFiltrationConfig] = node(
        PolicyFiltrationConfig, "null: off; {method, weight_pow}: PF-PPO's re-sampling of the trained batch by reward"
    )
    rto: Optional[RTOConfig] = node(RTOConfig, "null: off; {dpo_model, beta_dpo, sparse_coef}: RTO's dense DPO token reward")
    qrpo: Optional[QRPOConfig] = node(QRPOConfig, "null: off; {reference_samples, reference_cache}: QRPO's K pi_ref samples "
                                      "per prompt as each response's reference set (loss qrpo only)")
    step_critic: Optional[StepCriticConfig] = node(StepCriticConfig, "null: off; {k, boundary, step_tokens, max_steps, "
                                                   "epochs, lr, batch_size, path}: Direct Advantage PO's critic trained "
                                                   "apart, valuing the steps of rollout=offline's responses")
    preference_model: Optional[PreferenceModelConfig] = node(
        PreferenceModelConfig, "null: off; {epochs, lr, batch_size, path}: DRPO's Bradley-Terry preference model, fitted "
        "apart on rollout=offline's labelled pairs (loss dr_preference only)")
    online_prm: Optional[OnlinePRMConfig] = node(
        OnlinePRMConfig, "null: off; {beta, lr, updates, baseline}: OPRL's implicit PRM, a copy of the initial policy trained "
        "online on each step's outcome-ranked pairs (advantage oprl only)")
    update: UpdateConfig = node(UpdateConfig, "update schedule and its settings")
    critic: Optional[CriticConfig] = node(CriticConfig, "null: no critic; {coef, clip, model, lr}: PPO's critic (advantage gae, poad)")
    overlong_filter: bool = knob(False, "mask responses truncated at rollout.max_new_tokens out of the loss (DAPO)")
    reward_shaping: list = knob([], "list of {name, parameters} reward-shaping functions, applied in order", piece="reward_shaping")
    reincarnate_at: Optional[int] = knob(
        None, "ReMix's policy reincarnation at this step: the KL reference becomes the policy as it is then and a replay "
        "rollout stops replaying (on-policy from then on); SACPO's stage 2 starts here; null: never", ge=2
    )
    rollout_n: Optional[int] = knob(None, "the group size the method prescribes; rollout.n follows it unless set", ge=1)
    baseline: Optional[BaselineConfig] = node(BaselineConfig, "baseline_rewards source (remax, pvpo)")
    tracker: Optional[TrackerConfig] = node(TrackerConfig, "SPO's tracker (advantage spo)")
    deviations: list = knob([], "where the preset departs from the paper, one sentence each")
    fidelity: Optional[FidelityConfig] = node(FidelityConfig, "null: not stated; how much of its method the preset builds")


# Bounds of piece parameters that mean the same in every piece that takes them (a clip range is a width).
PIECE_PARAMETER_BOUNDS = {
    "clip_low": {"ge": 0},
    "clip_high": {"ge": 0},
    "epsilon": {"ge": 0},
    "gamma": {"ge": 0, "le": 1},
    "lam": {"ge": 0, "le": 1},
}

# Keys that moved: the unknown-key message says where to.
MOVED_KEYS = {
    "trainer.strategy": "trainer.parallelism (single | ddp | fsdp | swarm): renamed so that 'strategy' names the rollout "
    "strategy alone (rollout=<strategy>)",
    "algorithm.dynamic_sampling": "the rollout strategy: select rollout=dynamic_sampling and set "
    "rollout.dynamic_sampling.max_rounds / .metric (algorithm=dapo selects it; rollout=iid turns it off)",
}


# ----------------------------------------------------------------------------------------- the run


@dataclass
class PromptSamplerConfig:
    """``trainer.prompt_sampler`` (``prompt_sampler=<name>``): which prompts each step trains on (rlbench/training/curricula.py)."""

    name: str = knob(
        "uniform", "prompt sampler: uniform (shuffled passes) | weighted (by pass rate) | hard_focus (DRIVE)",
        settings_blocks=True,
    )
    fidelity: Optional[FidelityConfig] = node(FidelityConfig, "null: not stated; how much of its method the sampler builds")
    settings: dict = knob({}, "the settings blocks beside name, by sampler (filled by rlbench.config.typed)", derived=True)


@dataclass
class LoraConfig:
    """LoRA adapters through peft (arXiv:2106.09685): only the adapters train; the KL reference is the
    base model with adapters off (model/lora=default selects it)."""

    r: int = knob(8, "rank of the adapters", ge=1)
    alpha: float = knob(16.0, "scale numerator: the update is (alpha / r) B A", gt=0)
    dropout: float = knob(0.0, "dropout on the adapters' input", ge=0, le=0.99)
    target_modules: list = knob(["q_proj", "k_proj", "v_proj", "o_proj"], "names of the linear layers that get adapters")
    merge_on_save: bool = knob(False, "trainer.save_model writes base + adapters merged (a plain model); false: the adapters alone")
    per_role: bool = knob(False, "one adapter per role of the environment (env=proposer_verifier: proposer, verifier), each "
                          "sampling and training its role's turns on the same frozen base (model/lora=per_role); false: "
                          "one adapter for every role")


@dataclass
class ModelConfig:
    """``model``: where the policy comes from (rlbench/model)."""

    name: str = knob(None, "the model's short name (run names)")
    source: Literal["gguf_package", "tiny", "hub", "path"] = knob(None, "where the weights come from")
    gguf_package: Optional[str] = knob(None, "installed package holding the .gguf (source gguf_package, tiny's tokenizer)")
    gguf_file: Optional[str] = knob(None, "file inside the package (null: the only one)")
    hub_id: Optional[str] = knob(None, "Hugging Face model id (source hub)")
    path: Optional[str] = knob(None, "checkpoint directory (source path)")
    revision: Optional[str] = knob(None, "Hub revision")
    trust_remote_code: bool = knob(False, "allow the checkpoint's own modelling code")
    tiny: Optional[dict] = knob(None, "LlamaConfig fields of the random tiny model (source tiny)", open=True)
    add_tokens: list = knob([], "tokens added to the tokenizer, one id each (not special: decoded texts keep them), with new "
                            "embedding rows; ones the tokenizer has are kept (Thinkless' warm-up: [<short>,<think>])")
    lora: Optional[LoraConfig] = node(LoraConfig, "null: full fine-tuning | LoRA adapters (model/lora=default)")
    parameters: Optional[int] = knob(None, "about how many parameters (model card): a run whose model would not fit the device is refused before loading; null: not checked", ge=1)


@dataclass
class DifficultyFilterConfig:
    """``trainer.difficulty_filter``: an offline filter before step 1 (INTELLECT-2, arXiv:2505.07291): the initial
    policy (or ``model``, another model: the paper's distilled 7B) answers every training problem ``samples``
    times, and only the problems whose pass rate lies in [min_pass_rate, max_pass_rate] are trained on
    (rlbench/training/curricula.py)."""

    samples: int = knob(8, "responses of the initial policy per training problem", ge=1)
    min_pass_rate: float = knob(0.0, "drop the problems solved less often than this", ge=0, le=1)
    max_pass_rate: float = knob(1.0, "drop the problems solved more often than this (7/8 = 0.875: drop 8 of 8)", ge=0, le=1)
    model: Optional[ModelConfig] = node(
        ModelConfig, "null: the initial policy answers | a model node: that model answers instead, loaded before step 1 and "
        "freed after (INTELLECT-2's distilled model: +model@trainer.difficulty_filter.model=checkpoint "
        "trainer.difficulty_filter.model.path=<dir>)")


@dataclass
class AuxTasksConfig:
    """``trainer.aux_tasks``: auxiliary tasks built from earlier steps' graded rollouts mixed into each step's
    prompts (SPARK's judge tasks, arXiv:2509.22624; rlbench/training/aux_tasks.py, docs/judges.md)."""

    builder: Literal["spark"] = knob("spark", "what builds the tasks: spark (pointwise, pairwise, reflection judge tasks)")
    share: float = knob(0.25, "the share of each step's prompts drawn from the task buffer: round(share * prompts_per_step) "
                        "of them (at least 1 when share > 0, at most prompts_per_step - 1), fewer (counted: aux_shortfall) while the buffer holds too few; in [0, 1)")
    kinds: list = knob(["pointwise", "pairwise", "reflection"], "the task kinds built: pointwise (is it correct? label: the "
                       "verifier's), pairwise (which of two is correct? mixed groups only, both orders), reflection (revise an "
                       "incorrect answer; graded by the run's grader), eis_pairwise (EIS-GRPO's judge task: a pairwise question posed in "
                       "both orders in one group; needs rollout=equivalent_states with two prefixes), execution (CodeRL+: predict the output "
                       "and final variables of a program the policy wrote, traced in the sandbox; needs reward=code)")
    per_group: int = knob(1, "items of each kind built per graded group (pairwise: pairs, each in both orders)", ge=1)
    capacity: int = knob(256, "tasks the buffer keeps; the oldest leave first", ge=1)
    sampling: Literal["uniform", "recent"] = knob(
        "uniform", "how a step draws its tasks: uniform (any task in the buffer, without replacement; a drawn task leaves) | "
        "recent (CodeRL+'s: the tasks of the newest build when it holds enough, else the newest tasks; drawn tasks stay)")
    balance: bool = knob(False, "draw half the tasks from verified-correct responses and half from incorrect ones (the "
                         "other side fills a shortfall); needs kinds built from one response (pointwise, reflection, execution)")


@dataclass
class SwarmConfig:
    """``trainer.swarm``: SAPO's swarm (arXiv:2509.08721), with trainer.parallelism=swarm (docs/scaling.md)."""

    external: int = knob(
        0, "J: groups per step taken from what the other actors published (their decoded text and token ids, pi_old "
        "as old_logprobs says); the actor samples I = prompts_per_step - J itself. 0: no sharing", ge=0)
    old_logprobs: Literal["receiver", "sender"] = knob(
        "receiver", "pi_old of a shared response: receiver (the paper: recomputed by the receiving actor's policy, as its "
        "own samples) | sender (off-policy, pi_old = the sender's sampling log-probs: the ratio pi_receiver / mu_sender)")
    models: list = knob(
        [], "one model per actor, in actor order (a heterogeneous swarm): a conf/model option name (smollm2_135m), a "
        "checkpoint folder, a mapping of model fields over the run's model ({tiny: {vocab_size: 320}}) or null (the run's "
        "model); a receiver whose tokenizer differs from the sender's trains on its own tokens of the sent text. [] : "
        "every actor the run's model")
    pool_filter: Literal["none", "zero_advantage"] = knob(
        "none", "which of the others' published groups the J are drawn from: none (all) | zero_advantage (the paper's "
        "controlled runs: the receiver grades them all and drops the groups whose rewards are all equal, i.e. "
        "advantage 0; fewer than J left: the step trains on those)")
    lag: int = knob(
        0, "d: actor at step s draws its J shared groups from what the others published at step s - d, and the actors "
        "agree on a stop after step s from the signals of step s - d: no actor waits for the others' current step (the "
        "paper's asynchrony as a bounded, deterministic lag); steps 1..d sample all prompts locally. 0: synchronous", ge=0)


@dataclass
class TrainerConfig:
    """``trainer``: the optimisation loop around the algorithm."""

    steps: int = knob(24, "rollout -> update iterations", ge=0)
    prompts_per_step: int = knob(8, "prompts per batch; the batch holds prompts_per_step * rollout.n responses", ge=1)
    micro_batch_size: int = knob(16, "responses per forward/backward; gradients accumulate to the full batch", ge=1)
    lr: float = knob(3.0e-5, "AdamW learning rate", gt=0)
    weight_decay: float = knob(0.0, "AdamW weight decay", ge=0)
    betas: list = knob([0.9, 0.999], "AdamW betas")
    max_grad_norm: float = knob(1.0, "gradient-norm clip", gt=0)
    warmup_steps: int = knob(0, "linear learning-rate warm-up steps", ge=0)
    save_model: bool = knob(True, "save the trained policy (Hugging Face format) in the run folder")
    checkpoint_every: Optional[int] = knob(
        None, "write a checkpoint (weights, optimizer, random streams, all training state) every N steps and after "
        "the last, into <run>/checkpoints/; null: only when the run is interrupted (docs/resume.md)", ge=1)
    keep_checkpoints: int = knob(2, "keep the last K checkpoints (an unreadable newest one falls back to the previous)", ge=1)
    prompt_sampler: PromptSamplerConfig = node(PromptSamplerConfig, "which prompts each step trains on (prompt_sampler=<name>, conf/prompt_sampler/)")
    difficulty_filter: Optional[DifficultyFilterConfig] = node(
        DifficultyFilterConfig, "null: train on every problem; {samples, min_pass_rate, max_pass_rate, model}: keep only the "
        "problems the initial policy (or model) solves at a pass rate in the band, measured before step 1 (INTELLECT-2)")
    aux_tasks: Optional[AuxTasksConfig] = node(
        AuxTasksConfig, "null: none; {builder, share, kinds, per_group, capacity}: a share of each step's prompts drawn from "
        "tasks built from earlier rollouts, each with its own grader (SPARK: paper=spark; docs/judges.md)")
    stages: list = knob(
        [], "[{at: step, rollout.n: .., rollout.max_new_tokens: .., rollout.temperature: .., trainer.prompts_per_step: ..}]: "
        "settings that change from step `at` on (strictly increasing steps)"
    )
    max_staleness: Optional[int] = knob(
        None, "null: synchronous (generate, then update); k >= 0: a generator thread samples batch s with policy "
        "version max(0, s-1-k) while the learner updates (0 = the synchronous result through the pipeline)", ge=0
    )
    weight_sync_every: int = knob(
        1, "j: the generator syncs its weights every j policy versions (batch s sampled by g(s) rounded up to a "
        "multiple of j; needs max_staleness >= j - 1); 1: every version", ge=1
    )
    generator_threads: Optional[int] = knob(None, "torch threads of the generator thread (max_staleness set); null: the process's", ge=1)
    parallelism: Literal["single", "ddp", "fsdp", "swarm"] = knob(
        "single", "single: one process | ddp: DistributedDataParallel | fsdp: FSDP2 fully_shard | swarm: SAPO's "
        "independent actors sharing rollouts (trainer.swarm); ddp/fsdp/swarm under torchrun (docs/scaling.md)"
    )
    swarm: SwarmConfig = node(SwarmConfig, "SAPO's swarm: shared groups per step (trainer.parallelism=swarm)")
    gradient_checkpointing: bool = knob(False, "recompute activations in the backward pass (less memory, ~1/3 more compute)")
    reuse_freed_memory: bool = knob(
        True, "CPU training: keep freed memory in the process heap (glibc mallopt) instead of unmapping it: large "
        "tensors skip a page fault per 4 KiB (SmolLM2 update -20%); resident memory stays at its peak"
    )
    precision: Literal["auto", "fp32", "bf16"] = knob(
        "auto", "forward precision: auto (bf16 autocast on CUDA, fp32 on CPU) | fp32 | bf16 (autocast, also on CPU); "
        "master weights stay fp32"
    )


@dataclass
class RolloutConfig:
    """``rollout``: how prompts become graded groups (the strategy) and how responses are sampled."""

    strategy: str = knob(
        "iid", "rollout strategy (rollout=<strategy>; rlbench-list lists them, docs/rollout.md)", settings_blocks=True
    )
    engine: Literal["hf", "vllm"] = knob("hf", "generation engine: hf (any device) | vllm (CUDA)")
    n: int = knob(4, "responses per prompt (group size)", ge=1)
    temperature: float = knob(1.0, "sampling temperature", ge=0)
    top_p: float = knob(1.0, "nucleus sampling mass, in (0, 1]", gt=0, le=1)
    max_new_tokens: int = knob(16, "longest response in tokens", ge=1)
    batch_size: int = knob(64, "sequences per generate call", ge=1)
    prefix_cache_mb: float = knob(
        0.0, "hf engine: MiB of KV kept across generate calls, so a request extending a kept sequence prefills only its "
        "new tokens (tree rounds; docs/rollout.md); 0: off; emptied when the weights change", ge=0
    )
    fidelity: Optional[FidelityConfig] = node(FidelityConfig, "null: not stated; how much of its method the strategy builds")
    settings: dict = knob({}, "the settings blocks rollout.<strategy>, by strategy (filled by rlbench.config.typed)", derived=True)


@dataclass
class PromptConfig:
    """The chat messages a problem is put into."""

    system: Optional[str] = knob(None, "system message (null: none)")
    user: str = knob(None, "user message template; must contain {problem}")


@dataclass
class ArithConfig:
    """The generated arithmetic task."""

    level: Any = knob(None, "difficulty level 1..5, or a list of distinct levels ([1, 2]) cycled prompt by prompt")
    seed: Optional[int] = knob(None, "generator seed (null: the run's seed)")
    train_size: Any = knob(None, "problems in the train split")
    test_size: Any = knob(None, "problems in the test split")


@dataclass
class ToyReposConfig:
    """The generated toy repositories (env=code_repair's problems; rlbench/dataset/toy_repos.py)."""

    seed: Optional[int] = knob(None, "generator seed (null: the run's seed)")
    train_size: Any = knob(None, "repositories in the train split")
    test_size: Any = knob(None, "repositories in the test split")


@dataclass
class FlawStepsConfig:
    """The generated step-split solutions, half with a planted error (FAPO's GenRM task; rlbench/dataset/flaw_steps.py)."""

    seed: Optional[int] = knob(None, "generator seed (null: the run's seed)")
    train_size: Any = knob(None, "problems in the train split")
    test_size: Any = knob(None, "problems in the test split")


@dataclass
class DatasetConfig:
    """A dataset or benchmark spec (rlbench/dataset); which keys apply depends on the loader."""

    name: str = knob(None, "the dataset's name")
    loader: str = knob("jsonl", "jsonl | arith | toy_repos | flaw_steps")
    split: Optional[str] = knob(None, "split to read (train, test, ...)")
    files: dict = knob({}, "split -> JSONL file name", open=True)
    hub_id: Optional[str] = knob(None, "Hugging Face dataset id (fallback when the local file is missing)")
    hub_config: Any = knob(None, "Hub dataset config name(s)")
    hub_splits: dict = knob({}, "split -> Hub split name", open=True)
    fields: dict = knob(
        {}, "problem / answer / tolerance (math) or the code keys -> the record's field: a name, a path "
        "(answer[0], meta.answer) or a list of candidates", open=True
    )
    prompt: PromptConfig = node(PromptConfig, "prompt templates ({problem} and, for JSONL records, any record field: {unit})")
    answer_format: Optional[str] = knob("raw", "how reference answers are written: raw | gsm8k (after '####') | boxed")
    answer_type: Optional[str] = knob(
        "math", "how the reference is read: math (decided from the answer) | number (a lone letter after it is a unit) | "
        "expression | set (unordered) | text (exact, no letter case) | code (tests)"
    )
    tolerance: Optional[float] = knob(None, "relative tolerance of numeric answers; null: reward.tolerance", ge=0)
    absolute_tolerance: float = knob(0.0, "added to it: |pred - ref| <= tolerance * |ref| + absolute_tolerance", ge=0)
    truncated_fallback: bool = knob(
        True, "a response cut at max_new_tokens may be graded by the 'the answer is' / last-number fallbacks; "
        "false: only an explicit \\boxed{} or ####"
    )
    last_number_fallback: bool = knob(
        True, "a response without \\boxed{}, #### or 'the answer is' is graded on its last number (not one inside "
        "a word: H2O); false: such a response gets no answer (no reward for text that merely contains the digit)"
    )
    answer_labels: str = knob(
        "letter", "which 'label =' before an answer is dropped: letter (x = 3) | any (also AB = 4, f(x) = 1, (p,q) = (3,2))"
    )
    list_order: str = knob(
        "problem", "a bare comma list is: problem (ordered when the problem asks for an order: 'in increasing "
        "order') | ordered | unordered"
    )
    allow_empty: bool = knob(False, "zero usable problems: false = an error before the model loads, true = a row marked empty")
    reward_extraction: Optional[str] = knob(None, "how the answer is extracted from a response")
    id_field: Optional[str] = knob("id", "field that identifies a problem; null (JSONL math sets): uids by position")
    id_range: dict = knob({}, "split -> [first, last] id", open=True)
    meta_fields: list = knob([], "fields kept as metadata")
    limit: Optional[int] = knob(None, "read at most this many problems", ge=1)
    skip_bad_answers: bool = knob(False, "skip problems whose answer cannot be parsed")
    example_test_in_prompt: bool = knob(False, "show one test in the prompt (code)")
    test_format: Optional[str] = knob("assert_list", "how tests are written (code): assert_list | check_function")
    arith: Optional[ArithConfig] = node(ArithConfig, "settings of loader=arith")
    toy_repos: Optional[ToyReposConfig] = node(ToyReposConfig, "settings of loader=toy_repos")
    flaw_steps: Optional[FlawStepsConfig] = node(FlawStepsConfig, "settings of loader=flaw_steps")


@dataclass
class EvalConfig:
    """``eval``: the benchmark suite scored before and after training."""

    name: str = knob(None, "the suite's name")
    n: int = knob(4, "samples per problem", ge=1)
    k: list = knob([1], "the k of pass@k (each 1 <= k <= n)")
    temperature: float = knob(0.6, "sampling temperature", ge=0)
    top_p: float = knob(0.95, "nucleus sampling mass, in (0, 1]", gt=0, le=1)
    max_new_tokens: int = knob(1024, "longest response in tokens", ge=1)
    limit: Optional[int] = knob(None, "problems per benchmark at most (null: all)", ge=1)
    before_training: bool = knob(True, "also evaluate the model before training")
    every: Optional[int] = knob(None, "also evaluate every N training steps (pass@k curves: eval/curve.csv, wandb); null: before and after only", ge=1)
    benchmarks: dict = knob({}, "benchmark name -> dataset spec", values=DatasetConfig)
    rounds: int = knob(1, "rounds of MOTIF's multi-round inference per sample (rollout=multiround's progress prompts; "
                       "graded on the last round); 1: one response", ge=1)
    prompt: Optional[PromptConfig] = node(PromptConfig, "null: each benchmark is posed in its own prompt; {system, user}: every "
                                          "benchmark in this one (paper=motif: MOTIF's system prompt, /dataset/prompt@eval.prompt=motif)")
    judge_accuracy: bool = knob(False, "also pose each sample (and each mixed problem's pair) to the policy as SPARK's judge tasks and score its "
                                "verdicts against the verifier's (judge_accuracy, balanced, unparsed; rlbench/eval/judge_accuracy.py)")
    self_reflection: bool = knob(False, "SPARK's test-time self-reflection: the policy judges each sample with the pointwise judge task and, "
                                 "unless it says yes, revises it with the reflection task; pass@k is on the final answers, and the rows "
                                 "count revisions, wrong->right and right->wrong (rlbench/eval/self_reflection.py)")
    reflection_rounds: int = knob(2, "with self_reflection: judge-then-revise rounds per sample at most (the authors' evaluation: 2)", ge=1)


@dataclass
class SandboxConfig:
    """``sandbox``: limits for model-written code. Their types, bounds and ceilings are checked by
    ``rlbench.sandbox.limits_from_config`` (one place), so the fields here are untyped."""

    timeout_s: Any = knob(5.0, "wall clock per program, seconds")
    memory_mb: Any = knob(1024, "address-space limit, MiB")
    file_size_mb: Any = knob(16, "largest file a program may write, MiB")
    max_output_bytes: Any = knob(65536, "captured output per program, bytes")
    max_reply_bytes: Any = knob(1 << 20, "longest result (JSON) the trusted side decodes, bytes")
    cpu_cores: Any = knob(1.0, "CPU quota of one run's cpu cgroup, cores")
    bwrap_fallback: Any = knob(False, "bubblewrap installed but failing: run the weaker fallback instead of a sandbox_error")
    workers: Any = knob(None, "programs in parallel (a positive integer); null: one per CPU core")


@dataclass
class JudgeConfig:
    """``reward.judge``: the judge the judge terms of ``reward.terms`` ask (rlbench/reward/judges.py; docs/judges.md)."""

    kind: Literal["scripted", "policy", "frozen", "model"] = knob(
        "scripted", "scripted: a rule, no model (tests, CPU experiments) | policy: the policy itself, its current "
        "weights | frozen: a frozen copy of the initial policy | model: another model (+model@reward.judge.model=tiny)")
    rule: Literal["shorter", "longer", "bare_answer"] = knob(
        "shorter", "scripted: shorter / longer (pairwise: prefers the shorter / longer response) | bare_answer "
        "(pointwise: a response without working, no operator or '=', is flawed)")
    model: Optional[ModelConfig] = node(ModelConfig, "kind=model: the judge's model (+model@reward.judge.model=<option>)")
    verdict: Literal["probability", "label", "step_index"] = knob(
        "probability", "probability: P(first label) / P(first or second label) as the next token | label: the first "
        "label found in a greedy answer of max_new_tokens (none found: a failed verdict) | step_index (pointwise, "
        "FAPO's GenRM): the response split into numbered steps, a greedy answer read as the earliest wrong step; "
        "flawed iff it is not -1 (unreadable: a failed verdict)")
    pairwise_template: Optional[str] = knob(
        None, "the pairwise prompt, with {question}, {first}, {second}; null: rlbench.reward.judges.PAIRWISE_TEMPLATE")
    pointwise_template: Optional[str] = knob(
        None, "the pointwise prompt, with {question}, {response}, {reference_line} (verdict=step_index: also {steps}, "
        "the numbered steps); null: POINTWISE_TEMPLATE (verdict=step_index: rlbench.reward.genrm.STEP_INDEX_TEMPLATE)")
    pairwise_labels: list = knob(["A", "B"], "the labels meaning 'the first response is better' and 'the second is'")
    pointwise_labels: list = knob(["yes", "no"], "the labels meaning 'flawed' and 'sound'")
    max_new_tokens: int = knob(8, "verdict=label: the answer's length in tokens", ge=1)
    batch_size: int = knob(16, "prompts per judge call", ge=1)
    cache: bool = knob(True, "keep verdicts by (judge, prompt) for the run (never for kind=policy: its weights change)")
    time_budget_s: Optional[float] = knob(None, "the judge's own seconds per step; then the rest of the step's items fail (null: none)", gt=0)
    token_budget: Optional[int] = knob(None, "tokens (prompt + answer) of judge calls per step; then items fail (null: none)", ge=1)
    failure_reward: Optional[float] = knob(
        None, "a judge term's value for a failed verdict (unparseable, over budget), counted; null: the term's "
        "neutral value (pairwise_rl 0.5, brpo 0, fapo 0)")
    sees_reference: bool = knob(False, "show the reference answer to the pointwise judge (fapo); false: it never sees it")


@dataclass
class RewardConfig:
    """``reward``: the grader (rlbench/reward); the keys that apply depend on the option."""

    name: Literal["math", "code", "even_tokens", "fapo_genrm"] = knob(
        None, "the grader (fapo_genrm: FAPO's GenRM reward on dataset=flaw_steps, rlbench/reward/genrm.py)")
    correct_reward: float = knob(1.0, "reward of a correct response")
    incorrect_reward: float = knob(0.0, "reward of an incorrect response")
    format_weight: float = knob(0.0, "added when an answer in the expected format was found (math)")
    tolerance: float = knob(1.0e-6, "relative tolerance for numeric answers (math)", ge=0)
    extraction: Optional[str] = knob(None, "null: the dataset's reward_extraction (math); auto | boxed | gsm8k | last_number | "
                                     "answer_tag (auto inside <answer>...</answer>)")
    verify_timeout_s: float = knob(5.0, "seconds one math-verify comparison may take (math)", gt=0)
    mode: Literal["all_pass", "pass_rate"] = knob("all_pass", "all_pass: 1 when every test passes | pass_rate: the share of tests passed (code)")
    threshold: float = knob(0.75, "reward at which a response counts as correct (even_tokens)")
    terms: dict = knob(
        {"grader": 1.0}, "term -> weight: the reward is the weighted sum of the terms (grader, format, pairwise_rl, "
        "brpo, fapo, xml_count, soft_format, strict_format; rlbench/reward/terms.py), each logged as reward_term_<name>", open=True)
    judge: Optional[JudgeConfig] = node(JudgeConfig, "null: no judge | the judge the judge terms ask (docs/judges.md)")
    fidelity: Optional[FidelityConfig] = node(FidelityConfig, "null: not stated; how much of its method a reward preset builds (reward=fapo)")


@dataclass
class LoggerConfig:
    """``logger``: files only, or Weights & Biases as well."""

    name: Literal["files", "wandb"] = knob(None, "the logger")
    mode: str = knob("auto", "wandb: auto (online when WANDB_API_KEY is set, else offline) | online | offline | disabled")
    project: str = knob("rlbench", "W&B project")
    entity: Optional[str] = knob(None, "W&B entity")
    group: Optional[str] = knob(None, "W&B group")
    tags: list = knob([], "W&B tags")


@dataclass
class GuidanceConfig:
    """``guidance``: traces the guided methods learn from (rlbench/guidance/traces.py; docs/guidance.md)."""

    source: Literal["none", "dataset", "jsonl", "even_tokens"] = knob(
        "none", "none | dataset (the dataset's worked solutions) | jsonl (a file of traces keyed by uid) | even_tokens (toy)"
    )
    path: Optional[str] = knob(None, "the JSONL file of traces (source jsonl)")
    keep_incorrect: bool = knob(False, "keep traces the run's grader marks wrong (also: mode=generate writes them)")
    on_bad: Literal["skip", "stop"] = knob(
        "skip", "bad traces (unknown uid, empty, too long, tokenizer mismatch, wrong): skip = count, log, go on; stop = refuse before training"
    )
    max_tokens: Optional[int] = knob(None, "the longest trace in tokens; null: rollout.max_new_tokens", ge=1)


@dataclass
class WarmupConfig:
    """``warmup``: mode=generate writes Thinkless' paired warm-up data (arXiv:2505.13379, section 3.1;
    rlbench/guidance/warmup.py; docs/algorithms.md) instead of the policy's traces."""

    think: ModelConfig = node(ModelConfig, "the reasoning teacher (+model@warmup.think=<option>): its responses get think_token")
    short: ModelConfig = node(ModelConfig, "the concise teacher (+model@warmup.short=<option>): its responses get short_token")
    think_token: str = knob("<think>", "the control token written before the reasoning teacher's responses")
    short_token: str = knob("<short>", "the control token written before the concise teacher's responses")


@dataclass
class EnvConfig:
    """``env``: the environment of a multi-turn episode (rollout=multi_turn; conf/env/; docs/agents.md).
    The caps are per episode; an episode that reaches one ends with that reason, counted."""

    name: str = knob(None, "the environment (env=<name>; rlbench-list lists them)", settings_blocks=True)
    max_turns: int = knob(4, "policy turns per episode", ge=1)
    turn_tokens: int = knob(32, "policy tokens per turn (the engine's budget of one turn)", ge=1)
    max_tokens: int = knob(256, "response tokens per episode, policy and observation tokens together", ge=1)
    max_tool_calls: int = knob(4, "tool calls per episode: the episode ends after the last allowed one, or, where the "
                               "environment answers after it (python_tool), at a call past it (not run)", ge=0)
    max_observation_tokens: int = knob(128, "longest observation in tokens; a longer one ends the episode", ge=1)
    step_timeout_s: float = knob(30.0, "seconds one environment step may take (tool runs included); longer ends the episode", gt=0)
    workers: Optional[int] = knob(None, "environment steps run at once (tool runs in the sandbox); null: one per CPU core", ge=1)
    settings: dict = knob({}, "the settings block env.<name> (filled by rlbench.config.typed)", derived=True)


@dataclass
class RunConfig:
    """The whole composed config (conf/config.yaml and its groups)."""

    seed: int = knob(0, "seeds python, numpy, torch, the data order, the sampler and the eval sampler")
    mode: Literal["train", "eval", "generate"] = knob(
        "train", "train: eval, train, eval | eval: evaluation only | generate: write graded traces of the dataset to `out` "
        "(or RLEP's pool of verified successes to rollout.replay.pool_save)"
    )
    out: Optional[str] = knob(None, "mode=generate: the JSONL file of graded traces it writes")
    warmup: Optional[WarmupConfig] = node(WarmupConfig, "null | mode=generate: two teachers' paired responses, each after "
                                          "its control token (Thinkless' warm-up data)")
    device: str = knob("auto", "auto (cuda if available, else cpu) | cpu | cuda[:i]")
    data_dir: Optional[str] = knob(None, "local JSONL folder; RLBENCH_DATA_DIR wins")
    data_source: Literal["auto", "local", "hub"] = knob("auto", "auto (local file, else Hub) | local | hub")
    cache_dir: Optional[str] = knob(None, "converted checkpoints; default $RLBENCH_CACHE or ~/.cache/rlbench")
    output_dir: str = knob(None, "the run folder")
    run_name: str = knob(None, "the run's name (folder suffix, W&B name)")
    resume: Optional[str] = knob(
        None, "a run folder, or auto (the run below results/runs/ with the newest checkpoint): continue that run "
        "from its latest valid checkpoint with the same config (docs/resume.md)")
    resume_allow: list = knob([], "config keys (or nodes) a resumed run may change, e.g. [trainer.steps]; any "
                              "other change from the checkpoint's config is refused, listing the keys")
    resume_evaluate_again: bool = knob(False, "resume= of a finished run with nothing left to train: true runs its "
                                       "final evaluation again; false (default) says it finished and exits")
    sandbox: SandboxConfig = node(SandboxConfig, "limits for model-written code")
    algorithm: AlgorithmConfig = node(AlgorithmConfig, "the RL algorithm (algorithm=<preset>)")
    model: ModelConfig = node(ModelConfig, "the policy model (model=<option>)")
    dataset: DatasetConfig = node(DatasetConfig, "the training set (dataset=<option>)")
    reward: RewardConfig = node(RewardConfig, "the grader (reward=<option>)")
    rollout: RolloutConfig = node(RolloutConfig, "training-time sampling (rollout=<option>)")
    eval: EvalConfig = node(EvalConfig, "the evaluation suite (eval=<option>)")
    logger: LoggerConfig = node(LoggerConfig, "where metrics go (logger=<option>)")
    trainer: TrainerConfig = node(TrainerConfig, "the optimisation loop (trainer=<option>)")
    guidance: GuidanceConfig = node(GuidanceConfig, "traces the guided methods learn from (guidance=<source>)")
    env: Optional[EnvConfig] = node(EnvConfig, "null: single-turn | the multi-turn environment (env=<name>, rollout=multi_turn)")
    paper: Optional[dict] = knob(
        None, "a paper's setting with its reference numbers, deviations and fidelity (paper=<name>)", open=True,
        typed_keys={"fidelity": FidelityConfig},
    )
