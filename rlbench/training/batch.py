"""The training batch: graded groups stacked into padded tensors, and the views an update takes of it.

Layout: prompts are LEFT-padded to a common width P and responses RIGHT-padded to a common length
T, so every response starts at column P. The logits that predict response token t sit at column
P - 1 + t, and only the last T + 1 columns need the LM head (see rlbench.training.forward).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Sequence

import torch

from rlbench.algorithm.step_inputs import STEP_INPUTS
from rlbench.rollout.engines.base import Completion
from rlbench.training.distributed import global_counts


def _column(level: str, default: bool = True) -> Any:
    """A TrainBatch tensor field and how a sub-batch takes it (``level``): ``input`` [B, P+T] (trimmed to
    the prompt and the kept response), ``token`` [B, T] (trimmed to the kept response), ``row`` [B]."""
    return field(default=None, metadata={"level": level}) if default else field(metadata={"level": level})


@dataclass
class TrainBatch:
    input_ids: torch.Tensor = _column("input", default=False)  # [B, P+T]
    attention_mask: torch.Tensor = _column("input", default=False)  # [B, P+T]
    response_mask: torch.Tensor = _column("token", default=False)  # [B, T] float
    prompt_width: int  # P
    group_index: torch.Tensor = _column("row", default=False)  # [B] long
    rewards: torch.Tensor | None = _column("row")  # [B]
    correct: torch.Tensor | None = _column("row")  # [B] bool, the grader's verdicts (the correct responses' NLL term)
    advantages: torch.Tensor | None = _column("token")  # [B, T]
    old_logp: torch.Tensor | None = _column("token")  # [B, T]
    ref_logp: torch.Tensor | None = _column("token")  # [B, T]
    prev_logp: torch.Tensor | None = _column("token")  # [B, T] the policy before this step's update, every token (convex KL)
    kl_scale: torch.Tensor | None = _column("row")  # [B] factor of each response's loss KL (CLPO's dynamic KL), None = 1
    token_weights: torch.Tensor | None = _column("token")  # [B, T] policy-loss token mask (e.g. top-entropy), None = all 1
    sample_keep: torch.Tensor | None = _column("row")  # [B] bool, the responses the update trains on (D3S), None = all
    old_values: torch.Tensor | None = _column("token")  # [B, T] critic values of the sampling policy
    returns: torch.Tensor | None = _column("token")  # [B, T] critic regression targets
    sampling_logp: torch.Tensor | None = _column("token")  # [B, T] the rollout engine's log-probs (Completion.logprobs)
    off_policy: torch.Tensor | None = _column("token")  # [B, T] float, 1 = token not sampled by pi_old (None: all on-policy)
    behaviour_logp: torch.Tensor | None = _column("token")  # [B, T] log mu of the behaviour policy (NaN: unknown)
    policy_version: torch.Tensor | None = _column("row")  # [B] long, the policy version that sampled each response
    reference_rewards: torch.Tensor | None = _column("row")  # [B, K] QRPO's reference rewards of each response's prompt (rlbench/training/reference_rewards.py)
    preference_scores: torch.Tensor | None = _column("row")  # [B] r_phi of DRPO's preference model (rlbench/training/preference_model.py)
    reference_stage: int = 1  # 2 once algorithm.reincarnate_at made the policy the reference (SACPO's stage 2)
    # [B, T] each, the strategy inputs the completions carry (Completion.extras; rlbench/algorithm/step_inputs.py)
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def response_ids(self) -> torch.Tensor:
        """[B, T] long: the response token ids (padding included)."""
        return self.input_ids[:, self.prompt_width : self.prompt_width + self.response_mask.shape[1]]

    @property
    def has_off_policy(self) -> bool:
        """True when some trainable token was not sampled by pi_old."""
        return self.off_policy is not None and bool((self.off_policy * self.response_mask).any())

    def to(self, device: torch.device | str) -> "TrainBatch":
        """The batch with every tensor on ``device``."""
        moved = {f.name: getattr(self, f.name) for f in fields(self) if "level" in f.metadata}
        return replace(
            self,
            **{name: None if t is None else t.to(device) for name, t in moved.items()},
            extras={name: t.to(device) for name, t in self.extras.items()},
        )

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: torch.Tensor) -> "TrainBatch":
        """The sub-batch of ``rows``, trimmed to the longest response it holds."""
        response_len = last_trained_position(self.response_mask[rows]) if len(rows) else 0
        keep = max(response_len, 1)
        width = self.prompt_width + keep
        columns = {"input": (slice(None), slice(None, width)), "token": (slice(None), slice(None, keep)), "row": ()}

        def take(t: torch.Tensor | None, level: str) -> torch.Tensor | None:
            return None if t is None else t[rows][columns[level]]

        return replace(
            self,
            **{f.name: take(getattr(self, f.name), f.metadata["level"]) for f in fields(self) if "level" in f.metadata},
            extras={name: take(t, "token") for name, t in self.extras.items()},
        )


def collate(
    groups: Sequence[Sequence[Completion]],
    pad_token_id: int,
    device: torch.device | str = "cpu",
    current_version: int | None = None,
) -> TrainBatch:
    """Stack completions (grouped per prompt) into a left/right padded batch.

    The behaviour bookkeeping of each completion (rlbench.rollout.engines.base.Completion) becomes
    ``off_policy`` and ``behaviour_logp``: a token is off-policy where its completion says so, or,
    when it does not, every token of a completion sampled by a policy version older than
    ``current_version``. ``loss_mask`` zeros are taken out of the response mask (context tokens are
    never trained). The off-policy fields stay None when every token is on-policy."""
    flat = [(g, c) for g, group in enumerate(groups) for c in group]
    if not flat:
        raise ValueError("no completions to train on")
    prompt_width = max(len(c.prompt_ids) for _, c in flat)
    response_len = max(1, max(len(c.response_ids) for _, c in flat))
    B = len(flat)
    input_ids = torch.full((B, prompt_width + response_len), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    response_mask = torch.zeros(B, response_len)
    sampling_logp = torch.zeros(B, response_len)
    off_policy = torch.zeros(B, response_len)
    behaviour_logp = torch.zeros(B, response_len)
    versions = torch.tensor([-1 if c.policy_version is None else c.policy_version for _, c in flat], dtype=torch.long)
    for row, (_, c) in enumerate(flat):
        p, r = len(c.prompt_ids), len(c.response_ids)
        input_ids[row, prompt_width - p : prompt_width] = torch.tensor(c.prompt_ids, dtype=torch.long)
        attention_mask[row, prompt_width - p : prompt_width] = 1
        if r:
            input_ids[row, prompt_width : prompt_width + r] = torch.tensor(c.response_ids, dtype=torch.long)
            attention_mask[row, prompt_width : prompt_width + r] = 1
            response_mask[row, :r] = 1 if c.loss_mask is None else torch.tensor(c.loss_mask, dtype=response_mask.dtype)
            sampling_logp[row, :r] = torch.tensor(c.logprobs, dtype=sampling_logp.dtype)
            off_policy[row, :r] = token_off_policy(c, current_version)
            behaviour = c.logprobs if c.behaviour_logprobs is None else c.behaviour_logprobs
            behaviour_logp[row, :r] = torch.tensor(behaviour, dtype=behaviour_logp.dtype)
    group_index = torch.tensor([g for g, _ in flat], dtype=torch.long)
    any_off_policy = bool(off_policy.any())
    batch = TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        prompt_width=prompt_width,
        group_index=group_index,
        sampling_logp=sampling_logp,
        off_policy=off_policy if any_off_policy else None,
        behaviour_logp=behaviour_logp if any_off_policy else None,
        policy_version=versions,
        extras=padded_extras([c for _, c in flat], response_len),
    )
    return batch.to(device)


def padded_extras(completions: Sequence[Completion], width: int) -> dict[str, torch.Tensor]:
    """name -> [B, width] (or [B, width, K] for an input with K values per token, e.g. SofT-GRPO's top-k ids):
    each strategy input the completions carry (``Completion.extras``, one value per response token),
    padded with its STEP_INPUTS entry's ``pad`` in its ``dtype``. Every completion must carry the same inputs."""
    names = {name for c in completions for name in c.extras}
    out = {}
    for name in sorted(names):
        if name not in STEP_INPUTS or STEP_INPUTS[name].producer != "strategy":
            raise ValueError(f"Completion.extras[{name!r}] is not a strategy input of STEP_INPUTS (rlbench/algorithm/step_inputs.py)")
        entry = STEP_INPUTS[name]
        values = []
        for c in completions:
            if name not in c.extras:
                raise ValueError(f"a response without extras[{name!r}] is batched with responses that carry it")
            values.append(torch.tensor(c.extras[name], dtype=entry.dtype))
            if len(values[-1]) != len(c.response_ids):
                raise ValueError(f"extras[{name!r}] has {len(values[-1])} values for {len(c.response_ids)} response tokens")
        per_token = next((v.shape[1:] for v in values if len(v)), ())
        column = torch.full((len(completions), width, *per_token), entry.pad, dtype=entry.dtype)
        for row, v in enumerate(values):
            if len(v):
                column[row, : len(v)] = v
        out[name] = column
    return out


def token_off_policy(completion: Completion, current_version: int | None) -> torch.Tensor:
    """[len(response_ids)] float: 1 where the token was not sampled by pi_old (the policy at
    ``current_version``). The completion's own ``off_policy`` list wins; otherwise a completion
    stamped with an older policy version is off-policy in every token."""
    r = len(completion.response_ids)
    if completion.off_policy is not None:
        if len(completion.off_policy) != r:
            raise ValueError(f"off_policy has {len(completion.off_policy)} entries for {r} response tokens")
        return torch.tensor(completion.off_policy, dtype=torch.float32)
    stale = (
        current_version is not None
        and completion.policy_version is not None
        and completion.policy_version < current_version
    )
    return torch.full((r,), float(stale))


def last_trained_position(response_mask: torch.Tensor) -> int:
    """1 + the last column holding a trained token in any row (0 if none): the response length to
    keep. Equals the longest response when masks are contiguous; a loss mask with holes (context
    tokens inside a response) keeps the trained tokens after the hole."""
    positions = torch.arange(1, response_mask.shape[1] + 1, device=response_mask.device)
    return int(((response_mask > 0) * positions).max().item()) if response_mask.numel() else 0


def micro_batches(rows: torch.Tensor, micro_batch_size: int) -> list[torch.Tensor]:
    return [rows[i : i + micro_batch_size] for i in range(0, len(rows), micro_batch_size)]


def group_order(group_index: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """The batch's rows with whole groups kept together: the groups in a random order drawn from
    ``generator`` (in their batch order without one), each group's rows in batch order. Chunking it into
    mini-batches may still cut a group; ``whole_group_chunks`` does not."""
    groups = torch.unique(group_index)
    if generator is not None:
        groups = groups[torch.randperm(len(groups), generator=generator).to(groups.device)]
    return torch.cat([(group_index == g).nonzero().squeeze(-1) for g in groups.tolist()])


def whole_group_chunks(rows: torch.Tensor, group_index: torch.Tensor, size: int) -> list[torch.Tensor]:
    """``rows`` (whole groups, each contiguous) cut into consecutive chunks of at most ``size`` rows that
    never split a group; a group larger than ``size`` is a chunk of its own (a pairwise loss reads a group
    at once: registry.Needs.whole_groups)."""
    chunks: list[torch.Tensor] = []
    current: list[torch.Tensor] = []
    filled = 0
    groups = group_index[rows]
    boundaries = [0] + [k for k in range(1, len(rows)) if groups[k] != groups[k - 1]] + [len(rows)]
    for start, end in zip(boundaries, boundaries[1:]):
        if current and filled + (end - start) > size:
            chunks.append(torch.cat(current))
            current, filled = [], 0
        current.append(rows[start:end])
        filled += end - start
    if current:
        chunks.append(torch.cat(current))
    return chunks


def group_minibatches(group_index: torch.Tensor, minibatches: int, generator: torch.Generator | None) -> list[torch.Tensor]:
    """The batch split into ``minibatches`` mini-batches of whole groups (the groups shuffled by
    ``generator``), as even in groups as the group count allows."""
    order = group_order(group_index, generator)
    groups = group_index[order]
    starts = [0] + [k for k in range(1, len(order)) if groups[k] != groups[k - 1]]
    bounds = [starts[round(j * len(starts) / minibatches)] for j in range(minibatches)] + [len(order)]
    return [order[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


def batch_norms(batch: TrainBatch, rows: torch.Tensor, norm_length: int) -> dict[str, int]:
    """The optimizer batch's counts every aggregation normalises by (see rlbench.algorithm.aggregation);
    under trainer.parallelism=ddp|fsdp summed over the ranks, so the loss is one function of the whole
    batch (rlbench.training.distributed). ``correct_*``: the same counts of its correct responses (the
    correct responses' NLL term, Algorithm.positive_nll; 0 when the batch holds no verdicts)."""
    correct = rows[batch.correct[rows].bool()] if batch.correct is not None else rows[:0]
    counts = global_counts(*(
        count for subset in (rows, correct) for count in (
            int(batch.response_mask[subset].sum().item()), len(subset), len(torch.unique(batch.group_index[subset])))
    ))
    names = ("batch_tokens", "batch_sequences", "batch_groups")
    return {**dict(zip(names, counts[:3])), **{f"correct_{name}": n for name, n in zip(names, counts[3:])},
            "norm_length": norm_length}


def mask_truncated(batch: TrainBatch, finished: torch.Tensor) -> TrainBatch:
    """DAPO's overlong filtering (Yu et al. 2025, arXiv:2503.14476, section 3.4): a response that
    hit the generation budget without EOS is masked out of the loss, m_it = 0 for all its tokens,
    so it adds neither to the policy loss, the KL and entropy terms nor to token_mean's token count.

    The advantages are computed before masking (the truncated response still counts in its group's
    statistics). Under the seq_mean_* aggregations a masked response still counts in N_seq.
    """
    keep = finished.to(batch.response_mask.device, batch.response_mask.dtype)[:, None]
    advantages = None if batch.advantages is None else batch.advantages * keep
    return replace(batch, response_mask=batch.response_mask * keep, advantages=advantages)


def kept_responses(batch: TrainBatch) -> TrainBatch:
    """The sub-batch of the responses ``sample_keep`` selects (D3S's sample level,
    rlbench.algorithm.downsampling): the others contribute no token and no sequence to any term of
    the loss, and cost no forward. The batch itself when every response is kept (or no selection)."""
    if batch.sample_keep is None or bool(batch.sample_keep.all()):
        return batch
    return batch.select(batch.sample_keep.nonzero().squeeze(-1))


def trainable_tokens(batch: TrainBatch) -> int:
    """sum_i sum_t m_it w_it: the tokens the policy loss can move (response mask times the token
    mask, when the algorithm sets one). 0 means the step's gradient comes from no token at all."""
    mask = batch.response_mask if batch.token_weights is None else batch.response_mask * batch.token_weights
    return int((mask > 0).sum().item())
