"""Every input a piece of an algorithm can ask for, declared once: :data:`STEP_INPUTS`.

A piece (advantage estimator, policy loss, aggregation, KL estimator, reward shaping) reads the
inputs its signature names (rlbench.algorithm.registry). Each name it may use is one
:class:`StepInput` here: its shape, a line of documentation, the kinds of piece that read it and its
producer, the part of the run that computes it. Everything else is derived from these entries: the
input names of each registry, the inputs the trainer provides (the configuration is refused when a
piece requires one it does not), the runner's sources and the strategies' inputs
(rlbench/training/advantage_inputs.py), the loss step's inputs (rlbench/training/update.py), the
padding of strategy inputs (rlbench/training/batch.py ``collate``) and the inputs table of
docs/algorithms.md (docs/gen_tables.py).

Adding an input that a rollout strategy provides takes its producer module only: register the
entry there (``STEP_INPUTS.register(StepInput(..., producer="strategy"))``), list its name in the
strategy's ``provides`` and fill ``Completion.extras[name]`` with one value per response token; the
batch pads it to ``[B,T]`` with ``pad`` and the step hands it to the advantage that reads it. An input
of any other producer also needs that producer's code (a source in rlbench/training/advantage_inputs.py,
a TrainBatch field, ...); its entry goes here.

This module is the algorithm layer's: it imports nothing from rollout or training.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

#: The kinds of reader: the piece registries (rlbench.algorithm.registry) and the composition's own
#: terms of the loss (``objective``: the token mask, the KL and critic terms, the sampling correction).
READERS = ("advantage", "loss", "aggregation", "kl", "shaping", "objective")

#: Where an input comes from, in words (the docs table's legend).
PRODUCERS = {
    "batch": "a `TrainBatch` field (rlbench/training/batch.py): collate, the rewards, the advantages, the reference pass",
    "graded": "the graded groups (rlbench/rollout/groups.py): the grader's verdicts, the responses, the generation budget",
    "forward": "a forward pass of the policy (rlbench/training/forward.py): the no-grad sampling pass before the "
               "advantage (run only when something reads it; stored on the batch when the batch is reused) and the "
               "update's forward",
    "step": "the step itself (rlbench/training/step.py, update.py): the KL-in-reward token rewards, the training "
            "progress, the EWMA proximal policy's log-probs",
    "source": "a source of rlbench/training/advantage_inputs.py with state or extra rollouts: built, validated, "
              "asked before the advantage, told after the update, checkpointed",
    "strategy": "the rollout strategies that name it in `provides`, one value per response token in "
                "`Completion.extras`, padded by collate",
    "objective": "the composition (rlbench/algorithm/composition.py): the loss matrix and the optimizer batch's "
                 "counts (rlbench/training/batch.py batch_norms)",
    "default": "not provided by this trainer: the piece's default applies",
}


@dataclass(frozen=True)
class StepInput:
    """One input a piece may declare.

    name       the parameter name a piece reads it under
    shape      e.g. ``[B]``, ``[B,T] long``, ``int`` (B responses, T response tokens, V vocabulary)
    doc        one line: what it is
    producer   a key of :data:`PRODUCERS`
    readers    the kinds of piece (:data:`READERS`) that may read it
    when       the condition under which the trainer provides it, in words ("" = always)
    available  that condition on the algorithm (rlbench.algorithm.Algorithm); None = always
    dtype, pad a strategy input's padded tensor: its dtype and its value past a response's end
    """

    name: str
    shape: str
    doc: str
    producer: str
    readers: frozenset[str]
    when: str = ""
    available: Callable[[Any], bool] | None = None
    dtype: torch.dtype = torch.float32
    pad: float = 0.0

    def __post_init__(self) -> None:
        if self.producer not in PRODUCERS:
            raise ValueError(f"step input {self.name!r}: producer must be one of {sorted(PRODUCERS)}, got {self.producer!r}")
        unknown = set(self.readers) - set(READERS)
        if not self.readers or unknown:
            raise ValueError(f"step input {self.name!r}: readers must be a non-empty subset of {READERS}, got {sorted(self.readers)}")
        if bool(self.when) != (self.available is not None):
            raise ValueError(f"step input {self.name!r}: a condition needs both its words (when) and its test (available)")

    def provided_for(self, algorithm: Any) -> bool:
        """True when the trainer provides this input to ``algorithm``'s pieces."""
        return self.producer != "default" and (self.available is None or bool(self.available(algorithm)))


class StepInputs:
    """The registry of :class:`StepInput` entries, by name."""

    def __init__(self) -> None:
        self._entries: dict[str, StepInput] = {}

    def register(self, entry: StepInput) -> StepInput:
        """Add ``entry``; registering an equal entry again is a no-op, a different one under a taken name an error."""
        existing = self._entries.get(entry.name)
        if existing is not None and existing != entry:
            raise ValueError(f"step input {entry.name!r} is already registered as {existing}")
        self._entries[entry.name] = entry
        return entry

    def __getitem__(self, name: str) -> StepInput:
        return self._entries[name]

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[StepInput]:
        return iter(self._entries.values())

    def read_by(self, *readers: str) -> list[StepInput]:
        """The entries a piece of any of ``readers`` may read."""
        return [entry for entry in self if entry.readers & set(readers)]

    def names(self, *readers: str, producer: str | None = None) -> frozenset[str]:
        """The names read by ``readers`` (all when none given), of ``producer`` only when given."""
        entries = self.read_by(*readers) if readers else list(self)
        return frozenset(e.name for e in entries if producer is None or e.producer == producer)

    def provided(self, reader: str, algorithm: Any) -> set[str]:
        """The names of ``reader``'s inputs the trainer provides to ``algorithm``."""
        return {entry.name for entry in self.read_by(reader) if entry.provided_for(algorithm)}

    def markdown_table(self) -> str:
        """The inputs table of docs/algorithms.md: one row per entry, grouped by its first reader."""
        rows = ["| input | shape | read by | producer | what |", "|---|---|---|---|---|"]
        order = {reader: k for k, reader in enumerate(READERS)}
        for entry in sorted(self, key=lambda e: (min(order[r] for r in e.readers), e.name)):
            readers = ", ".join(sorted(entry.readers, key=order.__getitem__))
            what = entry.doc + (f" (only when {entry.when})" if entry.when else "")
            cells = [f"`{entry.name}`", entry.shape, readers, entry.producer, what]
            rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
        return "\n".join(rows) + "\n"


STEP_INPUTS = StepInputs()


def _declare(name: str, shape: str, doc: str, producer: str, readers: set[str], **options: Any) -> None:
    STEP_INPUTS.register(StepInput(name, shape, doc, producer, frozenset(readers), **options))


# ------------------------------------------------------------------------ the batch and the graded groups
_declare("rewards", "[B]", "each response's outcome reward after the algorithm's reward shaping (a pairwise loss "
         "ranks a group's responses by it)", "batch", {"advantage", "loss"})
_declare("group_index", "[B] long", "responses sharing a prompt share an index (0..G-1); group sizes may differ",
         "batch", {"advantage", "shaping", "loss"})
_declare("response_mask", "[B,T]", "1 on trained response tokens, 0 on padding and context tokens (a row may be all 0)",
         "batch", {"advantage", "loss", "aggregation", "objective"})
_declare("advantages", "[B,T]", "the advantage estimator's per-token advantages", "batch", {"loss"})
_declare("ref_logp", "[B,T]", "log pi_ref of the frozen reference model", "batch", {"loss", "kl", "objective"},
         when="the KL term is on (algorithm.kl.coef > 0) or the loss reads it (dpo, ipo)",
         available=lambda algorithm: algorithm.needs_reference)
_declare("reference_rewards", "[B,K]", "the rewards of K responses of pi_ref to each response's prompt (QRPO's "
         "reference set, arXiv:2507.08068 section 3; rlbench/training/reference_rewards.py); None otherwise, and "
         "qrpo uses the response's group", "batch", {"loss"},
         when="algorithm.qrpo.reference_samples = K > 0", available=lambda algorithm: algorithm.reference_samples > 0)
_declare("preference_scores", "[B]", "r_phi of each response under a Bradley-Terry preference model fitted before the "
         "actor (DRPO's learned preference model, arXiv:2506.01183 section 4; rlbench/training/preference_model.py); "
         "None otherwise, and dr_preference uses a Bradley-Terry model on the labels", "batch", {"loss"},
         when="algorithm.preference_model is set", available=lambda algorithm: algorithm.preference_model)
_declare("sampling_logp", "[B,T]", "the rollout engine's log-probs of the sampled tokens (Completion.logprobs; "
         "train/inference-mismatch corrections)", "batch", {"loss", "objective"})
_declare("off_policy", "[B,T]", "1 on tokens pi_old did not sample (traces, replay, stale data), else 0", "batch",
         {"loss"})
_declare("response_ids", "[B,T] long", "the response token ids o_t (with log_probs)", "batch", {"loss"})
_declare("token_weights", "[B,T]", "the policy-loss token mask (top-entropy quantile, D3S); None: every token",
         "batch", {"objective"})
_declare("returns", "[B,T]", "the critic's regression targets (GAE lambda-returns)", "batch", {"objective"},
         when="the algorithm has a critic (value head or separate model): algorithm.critic", available=lambda algorithm: algorithm.critic is not None)
_declare("prev_logp", "[B,T]", "the policy before this step's update, on every token (ReMix's convex KL)", "batch",
         {"objective"}, when="algorithm.kl.previous_weight > 0", available=lambda algorithm: algorithm.kl_previous_weight > 0)
_declare("kl_scale", "[B]", "each response's factor s_i of the loss's KL term by its problem's curriculum difficulty "
         "label (CLPO's dynamic KL, rlbench.algorithm.kl.difficulty_kl_scale; labels: prompt_sampler=clpo)", "batch",
         {"objective"}, when="algorithm.kl.difficulty_scale is not all 1",
         available=lambda algorithm: algorithm.kl_difficulty_scale is not None)
_declare("correct", "[B] bool", "the grader's verdict on each response (the batch keeps it: the loss step's NLL of the "
         "correct responses, algorithm.positive_nll_coef)", "graded", {"advantage", "shaping", "objective"})
_declare("outcome", "[B]", "the graders' reward of each response, before the algorithm's reward shaping "
         "(rewards - outcome is the shaping component: GDPO)", "graded", {"advantage"})
_declare("max_length", "int", "the generation budget, rollout.max_new_tokens", "graded", {"advantage", "shaping"})
_declare("response_lengths", "[B] long", "the number of response tokens", "graded", {"shaping"})
_declare("finished", "[B] bool", "True when the response ended with EOS, False when truncated", "graded", {"shaping"})
_declare("response_texts", "list[str]", "the decoded responses (special tokens skipped)", "graded", {"shaping"})
_declare("response_token_ids", "list[list[int]]", "each response's token ids o_1..o_|o| (CAMPO's loop detector "
         "compares token ids)", "graded", {"shaping"})
_declare("policy_code", "list[str]", "the closed ```python blocks the policy wrote in each response, joined by "
         "newlines (rlbench.reward.code.tool_blocks): rollout=multi_turn's policy turns only, without the observations "
         "(tool outputs) between them; the response text's blocks otherwise", "graded", {"shaping"})
_declare("problem_uids", "list[str]", "the uid of each response's problem (Problem.uid): INTELLECT-2's per-prompt "
         "length target is drawn from it (rlbench.algorithm.shaping.length_target)", "graded", {"shaping"})
_declare("first_tokens", "list[str]", "each response's first token decoded with special tokens kept (\"\" when "
         "empty): Thinkless' control token", "graded", {"shaping"})

# ------------------------------------------------------------------------ forward passes of the policy
_declare("logp", "[B,T]", "log pi_theta(o_t | q, o_<t), with gradient (the KL estimators: the policy's log-probs)",
         "forward", {"loss", "kl"})
_declare("old_logp", "[B,T]", "log pi_old of the policy that sampled the batch, no gradient (equals logp.detach() "
         "for one on-policy update; the behaviour policy's on off-policy tokens)", "forward",
         {"advantage", "loss", "objective"})
_declare("entropy", "[B,T]", "per-token entropy, no gradient: the sampling policy's (advantage), the current "
         "policy's (loss)", "forward", {"advantage", "loss", "objective"})
_declare("sum_pi_squared", "[B,T]", "sum over the vocabulary of pi_old(v | q, o_<t)^2, no gradient: the sampling "
         "policy's, from the logits of its old log-probs (the optimal token baseline's squared score norm "
         "1 - 2 pi(o_t) + sum_v pi(v)^2); computed only for an advantage that reads it", "forward", {"advantage"})
_declare("values", "[B,T]", "critic values V(s_t) of each response token", "forward", {"advantage", "objective"},
         when="the algorithm has a critic (value head or separate model): algorithm.critic", available=lambda algorithm: algorithm.critic is not None)
_declare("old_values", "[B,T]", "the sampling policy's critic values (the value clip)", "forward", {"objective"},
         when="the algorithm has a critic (value head or separate model): algorithm.critic", available=lambda algorithm: algorithm.critic is not None)
_declare("log_probs", "[B,T,V]", "full-vocabulary log pi_theta(. | q, o_<t), with gradient; computed only for a loss "
         "that reads it (otr)", "forward", {"loss"})

# ------------------------------------------------------------------------ the step
_declare("token_rewards", "[B,T]", "per-token rewards: the outcome at EOS minus the per-token KL penalty (RTO: plus "
         "beta_dpo (log pi_dpo - log pi_ref) on every token)", "step", {"advantage"},
         when="algorithm.kl.placement=reward, or algorithm.rto",
         available=lambda algorithm: algorithm.kl_in_reward or algorithm.rto is not None)
_declare("progress", "float", "the fraction of training done, in [0, 1] (annealed schedules)", "step", {"loss"})
_declare("reference_stage", "int", "1 while the reference is the initial policy, 2 once algorithm.reincarnate_at made "
         "the policy the reference (SACPO's stage 2)", "batch", {"loss"})
_declare("prox_logp", "[B,T]", "log-probs of decoupled PPO's proximal policy, an EWMA copy of the weights "
         "(no gradient)", "step", {"loss"})
_declare("generator", "torch.Generator", "the policy loss's random stream (clip_cov's random pick): a fresh generator "
         "per micro-batch, seeded from (run seed, step, rank, micro-batch index) (rlbench.utils.loss_generator): the "
         "same draws in a rerun and in a resumed run", "step", {"loss"})

# ------------------------------------------------------------------------ sources (rlbench/training/advantage_inputs.py)
_declare("baseline_rewards", "[B]", "the reward of a baseline for each response's prompt: one greedy response "
         "(algorithm.baseline.source=greedy, remax) or the frozen initial policy's mean reward, cached per prompt "
         "(reference, pvpo)", "source", {"advantage"})
_declare("tracker_baseline", "[B]", "SPO's tracked success probability p_hat(x) of each response's prompt before "
         "this step (algorithm.tracker)", "source", {"advantage"})
_declare("step_process_rewards", "[B,T] float64", "OPRL's implicit step reward r_phi(s_k, a_k) = beta sum_{t in a_k} "
         "(log pi_phi - log pi_base) (pi_base: pi_ref or the sampling policy, algorithm.online_prm.baseline) of the "
         "step k (the turn, step_index) each token belongs to, from the PRM trained online on this step's pairs just before (arXiv:2509.19199 section 3; rlbench/training/online_prm.py); 0 on "
         "observation tokens and padding", "source", {"advantage"},
         when="algorithm.online_prm is set", available=lambda algorithm: algorithm.online_prm is not None)
_declare("answer_keys", "[B] long", "class id of each response's canonical extracted answer (equal ids: same answer)",
         "source", {"advantage"})
_declare("diversity", "[B,B]", "pairwise dissimilarity in [0, 1] of responses: token-set Jaccard distance (only "
         "entries within a group are read)", "source", {"advantage"})

# ------------------------------------------------------------------------ rollout strategies (Completion.extras)
_declare("tree_nodes", "[B,T] long", "the tree node of every response token, -1 on padding (rollout=tree, treerpo; "
         "rollout=multi_turn with branch: entropy_tool)",
         "strategy", {"advantage"}, dtype=torch.long, pad=-1)
_declare("step_index", "[B,T] long", "the step (0, 1, ...) of every response token, -1 on padding (rollout=vine; "
         "rollout=multi_turn: the turn, -1 on observation tokens)",
         "strategy", {"advantage", "loss"}, dtype=torch.long, pad=-1)
_declare("prefix_stage", "[B,T] long", "the depth (revealed segments of the teacher's solution) of the prefix a "
         "response completes, on every token of the response, -1 on padding (rollout=mcts_prefix; read by sae)",
         "strategy", {"advantage"}, dtype=torch.long, pad=-1)
_declare("prefix_value", "[B,T] float64", "V(p) of the prefix a response completes: the rewards of the search tree's "
         "leaves that extend it (its subtree's rollouts), averaged, max or min (rollout=mcts_prefix's value_heuristic "
         "expectation / optimistic / pessimistic; read by sae baseline=tree_value)",
         "strategy", {"advantage"}, dtype=torch.float64)
_declare("step_values", "[B,T] float64", "V^ of the state where the token's step starts: the mean reward of "
         "continuations sampled from there (rollout=vine)", "strategy", {"advantage"}, dtype=torch.float64)
_declare("turn_states", "[B,T] long", "an id of the environment state each policy token's turn was taken in, -1 on "
         "observation tokens and padding (rollout=multi_turn)", "strategy", {"advantage"}, dtype=torch.long, pad=-1)
_declare("turn_rewards", "[B,T] float64", "the environment's reward of each policy token's turn (rollout=multi_turn)",
         "strategy", {"advantage"}, dtype=torch.float64)
_declare("sft_target", "[B,T]", "1 on the tokens of a response trained by supervised fine-tuning (Cog-Rethinker's "
         "stage successes under the direct prompt: rollout=rethink, successes sft), 0 elsewhere", "strategy", {"loss"})
# SofT-GRPO (arXiv:2511.06411): K values per token, read by the training forward (rlbench/training/soft_tokens.py)
_declare("soft_ids", "[B,T,K] long", "the top-k token ids a soft thinking step mixes (rollout=soft_thinking)",
         "strategy", {"objective"}, dtype=torch.long, pad=0)
_declare("soft_noisy_logp", "[B,T,K]", "y = log pi_k,old(v) + g_v: a soft step's Gumbel-perturbed top-k log-probs "
         "(rollout=soft_thinking)", "strategy", {"objective"})
_declare("soft_weights", "[B,T,K]", "softmax(y / tau_g): the mixture weights of a soft step's input embedding, all 0 "
         "on a discrete token (rollout=soft_thinking)", "strategy", {"objective"})

# ------------------------------------------------------------------------ the composition
_declare("loss_matrix", "[B,T]", "the policy loss's per-token matrix (or the KL / entropy / value term's)",
         "objective", {"aggregation"})
_declare("batch_tokens", "int", "trained tokens of the optimizer batch (summed over ranks)", "objective",
         {"aggregation"})
_declare("batch_sequences", "int", "responses of the optimizer batch (summed over ranks)", "objective",
         {"aggregation"})
_declare("batch_groups", "int", "groups (prompts) of the optimizer batch (summed over ranks): a pairwise loss's "
         "normaliser", "objective", {"aggregation"})
_declare("norm_length", "int", "the constant L of Dr. GRPO's normaliser: rollout.max_new_tokens", "objective",
         {"aggregation"})

# ------------------------------------------------------------------------ declared by pieces, not provided
_declare("control_mask", "[B,T]", "1 on control tokens (degrpo; default: each response's first token)", "default",
         {"loss"})
