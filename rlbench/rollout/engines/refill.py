"""In-engine refill (Infinite Sampling, Wang et al. 2025, arXiv:2506.22950, section 3: continuous sampling
with shortest-job-first refill): the HF engine decodes a queue of samples in at most ``slots`` rows at once,
and a row that ends (EOS or ``max_new_tokens``) leaves the batch at once while the next queued sample joins
it, so the other rows never wait for a round's longest (:meth:`HFGenerateEngine.generate_refilling` in
rlbench/rollout/engines/hf.py, which imports this module).

A joining sample is prefilled alone (samples joining at the same step in one left-padded pass, equal
prompts once); its keys and values are then put next to the running rows' with :func:`join_rows`:

* every row's keys and values stay **right-aligned**: the rows already running hold their positions at
  the right end of the cache (their unused left columns masked), the new rows' prefill sits at the
  right end too, and the shorter side is left-extended with masked zeros;
* columns that no row attends to any more (those of rows that left) are dropped from the left;
* each row keeps its **own position ids** (a joining prompt starts at 0, as when decoded alone), and the
  keys are stored already rotated, so moving a row's keys to other columns changes nothing it computes.

A row therefore attends to exactly its own prompt and tokens, at its own positions: its logits are those
of decoding it alone up to float rounding (masked columns add exact zeros; the sums' order and the
batch's composition differ), and with a random stream per sample (requests with their own ``seed``) its
tokens are those of decoding it alone, whichever slot and step it ran in.
"""

from __future__ import annotations

import torch

Layers = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values) [rows, kv_heads, columns, head_dim]


def live_columns(valid: torch.Tensor | None, width: int) -> int:
    """How many of the right-most of ``width`` columns some row attends to (``valid`` ``[rows, width]``
    bool, None: all of them); the columns to the left of them can be dropped."""
    if valid is None or valid.shape[0] == 0:
        return width if valid is None else 0
    used = valid.any(0)
    return width - int(used.long().argmax()) if bool(used.any()) else 0


def join_rows(
    old: Layers, old_valid: torch.Tensor | None, new: Layers, new_valid: torch.Tensor | None, room: int = 0
) -> tuple[Layers, torch.Tensor, int]:
    """The rows of ``old`` then those of ``new`` in one right-aligned cache (module docstring): returns the
    per-layer keys and values ``[old rows + new rows, kv_heads, width + room, head_dim]`` (``room`` empty
    columns on the right for later steps), the columns each row attends to ``[rows, width + room]`` (bool;
    the room's columns True) and ``width``. ``*_valid`` ``[rows, columns]`` bool, None: every column."""
    keys, new_keys = old[0][0], new[0][0]
    rows, fresh = keys.shape[0], new_keys.shape[0]
    kept_old = live_columns(old_valid, keys.shape[2])
    kept_new = live_columns(new_valid, new_keys.shape[2])
    width = max(kept_old, kept_new)
    layers: Layers = []
    for (k, v), (nk, nv) in zip(old, new):
        out_k = k.new_zeros((rows + fresh, k.shape[1], width + room, k.shape[3]))
        out_v = v.new_zeros((rows + fresh, v.shape[1], width + room, v.shape[3]))
        out_k[:rows, :, width - kept_old : width] = k[:, :, k.shape[2] - kept_old :]
        out_v[:rows, :, width - kept_old : width] = v[:, :, v.shape[2] - kept_old :]
        out_k[rows:, :, width - kept_new : width] = nk[:, :, nk.shape[2] - kept_new :]
        out_v[rows:, :, width - kept_new : width] = nv[:, :, nv.shape[2] - kept_new :]
        layers.append((out_k, out_v))
    valid = torch.zeros((rows + fresh, width + room), dtype=torch.bool, device=keys.device)
    valid[:, width:] = True
    for part, (start, stop), kept, columns in (
        (old_valid, (0, rows), kept_old, keys.shape[2]), (new_valid, (rows, rows + fresh), kept_new, new_keys.shape[2])
    ):
        valid[start:stop, width - kept : width] = True if part is None else part[:, columns - kept :]
    return layers, valid, width
