"""Training on several processes with PyTorch's own distributed engine (``trainer.parallelism``).

* ``single`` (default): one process, nothing here runs; the path is the one of every earlier run.
* ``ddp``: ``torch.nn.parallel.DistributedDataParallel``; every rank holds the whole model.
* ``fsdp``: FSDP2, ``torch.distributed.fsdp.fully_shard`` on every decoder layer and the root; each
  rank holds 1/world_size of the parameters, gradients and optimizer state.

Launch with ``torchrun --nproc_per_node N -m rlbench.cli trainer.parallelism=ddp ...`` (gloo on CPU,
NCCL on CUDA, one GPU per rank: ``cuda:LOCAL_RANK``). Without torchrun's environment a ``ddp`` /
``fsdp`` run is a world of one rank (a local rendezvous), e.g. FSDP with one rank on one GPU.

How a step is split (docs/scaling.md): every rank draws the same prompts (the data order is shared),
takes its contiguous share of WHOLE groups (:meth:`World.shard`), samples them with its own rollout
stream (f(seed, rank), :func:`rank_stream_seed`), grades them and computes the advantages of its
groups (group statistics need no other rank). The loss normalisers (N_tok, N_seq) are summed over
ranks (:func:`global_counts`), and the loss is scaled by world_size before backward because DDP and
FSDP average gradients over ranks (:func:`backward`): the reduced gradient is then the gradient of
the same loss on the whole batch (tests/test_distributed.py checks it to 1e-6 for every aggregation).

Checkpoint helpers (:func:`full_model_state` and friends) give plain full state dicts from a
wrapped or plain model via ``torch.distributed.checkpoint.state_dict`` (also single-process).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from rlbench.errors import ConfigError

PARALLELISMS = ("single", "ddp", "fsdp", "swarm")  # swarm: independent actors (rlbench/training/swarm.py)

# Rollout streams: rank r's generator seed is the single-process seed + r * RANK_STREAM_STRIDE, so
# rank 0 samples exactly what a single-process run samples.
RANK_STREAM_STRIDE = 7_919


@dataclass(frozen=True)
class World:
    """This process's place among the training processes."""

    rank: int = 0
    size: int = 1
    parallelism: str = "single"

    @property
    def is_main(self) -> bool:
        """Rank 0 writes the result files and logs to wandb."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.parallelism != "single"

    @property
    def sharded(self) -> bool:
        """FSDP: every forward is collective, so all ranks must run the same number of them."""
        return self.parallelism == "fsdp"

    def shard(self, items: Sequence[Any]) -> list[Any]:
        """This rank's contiguous share of ``items`` (prompts: each becomes one whole group)."""
        if len(items) % self.size:
            raise ConfigError(
                f"the world size {self.size} does not divide the {len(items)} prompts of a step; make "
                f"trainer.prompts_per_step a multiple of the number of processes"
            )
        share = len(items) // self.size
        return list(items[self.rank * share : (self.rank + 1) * share])

    def shard_padded(self, items: Sequence[Any]) -> tuple[list[Any], int]:
        """Round-robin share of ``items`` padded (with the last item) to the same length on every
        rank, and how many of them are real: evaluation shards problems this way so that every rank
        runs the same number of generate calls (needed under FSDP)."""
        own = list(items[self.rank :: self.size])
        length = -(-len(items) // self.size)
        return own + [items[-1]] * (length - len(own)), len(own)

    def gather(self, values: list[Any]) -> list[Any]:
        """Every rank's ``values`` concatenated in rank order (on every rank)."""
        if not self.distributed or self.size == 1:
            return list(values)
        parts: list[Any] = [None] * self.size
        dist.all_gather_object(parts, values)
        return [v for part in parts for v in part]

    def barrier(self) -> None:
        """Returns when every rank has called it."""
        if self.distributed and self.size > 1:
            dist.barrier()

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (a picklable object; returns only when every rank called it)."""
        if not self.distributed or self.size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def max_over_ranks(self, value: int) -> int:
        """The largest of the ranks' ``value`` (every rank gets it): a flag one rank raised reaches all."""
        if not self.distributed or self.size == 1:
            return int(value)
        total = torch.tensor([int(value)], dtype=torch.int64, device=_collective_device())
        dist.all_reduce(total, op=dist.ReduceOp.MAX)
        return int(total.item())

    def mean_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Each metric averaged over ranks (every rank must report the same keys)."""
        if not self.distributed or self.size == 1:
            return metrics
        keys = sorted(metrics)
        all_keys: list[Any] = [None] * self.size
        dist.all_gather_object(all_keys, keys)
        if any(k != keys for k in all_keys):
            raise RuntimeError(f"ranks report different step metrics: {all_keys}")
        values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=_collective_device())
        dist.all_reduce(values)
        return {k: float(v) / self.size for k, v in zip(keys, values.cpu().tolist())}


SINGLE = World()


def _collective_device() -> torch.device:
    """NCCL reduces CUDA tensors only; gloo CPU ones."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def rank_stream_seed(seed: int, rank: int) -> int:
    """The rollout stream of ``rank``: f(seed, rank), rank 0 = the single-process stream."""
    return seed + rank * RANK_STREAM_STRIDE


def launched_world_size() -> int:
    """The number of processes torchrun started (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def check_parallelism(parallelism: str, prompts_per_step: int, algorithm: Any, rollout_strategy: str) -> None:
    """Bad input refused before anything loads: an unknown parallelism, torchrun without one,
    a world size that does not divide the step's prompts, and what is not sharded yet."""
    world_size = launched_world_size()
    if parallelism not in PARALLELISMS:
        raise ConfigError(f"trainer.parallelism={parallelism!r} is unknown; use one of {', '.join(PARALLELISMS)}")
    if parallelism == "single":
        if world_size > 1:
            raise ConfigError(
                f"started as {world_size} processes (torchrun) with trainer.parallelism=single; set "
                "trainer.parallelism=ddp or trainer.parallelism=fsdp"
            )
        return
    if parallelism == "swarm":  # every actor is a single-process run; rlbench.training.swarm.check_swarm checks the rest
        return
    if prompts_per_step % world_size:
        raise ConfigError(
            f"the world size {world_size} does not divide trainer.prompts_per_step={prompts_per_step}: every "
            "rank trains on the same number of whole groups; use a multiple of the number of processes"
        )
    unsupported = []
    if algorithm.critic is not None:
        unsupported.append("a value head (algorithm.critic)")
    if algorithm.needs_proximal_policy:
        unsupported.append("the EWMA proximal policy (loss ppo_ewma)")
    if algorithm.schedule == "trpo":
        unsupported.append("algorithm.update.schedule=trpo")
    if rollout_strategy != "iid":
        unsupported.append(f"rollout={rollout_strategy}")
    if unsupported:
        raise ConfigError(
            f"trainer.parallelism={parallelism} does not shard {', '.join(unsupported)} yet; use trainer.parallelism=single"
        )


def rank_device(device: torch.device) -> torch.device:
    """One GPU per rank (cuda:LOCAL_RANK); CPU stays CPU."""
    if device.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return device


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_world(parallelism: str, device: torch.device) -> World:
    """Join the process group of a ``ddp`` / ``fsdp`` run (gloo on CPU, NCCL on CUDA); a world of one
    rank when torchrun did not start this process. ``single`` and ``swarm`` (each actor is a
    single-process run, rlbench/training/swarm.py): no process group."""
    if parallelism in ("single", "swarm"):
        return SINGLE
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # not under torchrun: one rank, local rendezvous
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(_free_port()))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return World(dist.get_rank(), dist.get_world_size(), parallelism)


def close_world(world: World) -> None:
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks (the classes a Hugging Face model names in ``_no_split_modules``)."""
    names = set(getattr(unwrap(model), "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def check_shardable(model: torch.nn.Module, world_size: int) -> None:
    """FSDP splits every parameter along its first dimension; one with fewer rows than ranks would
    leave some rank nothing of it: the model is too small to shard over this many ranks."""
    small = [(name, tuple(p.shape)) for name, p in model.named_parameters() if p.dim() == 0 or p.shape[0] < world_size]
    if small:
        name, shape = small[0]
        raise ConfigError(
            f"the model is too small to shard over {world_size} ranks: {len(small)} parameters have fewer than "
            f"{world_size} rows (e.g. {name} {list(shape)}); use trainer.parallelism=ddp or fewer processes"
        )


def wrap_model(model: torch.nn.Module, world: World) -> torch.nn.Module:
    """The module the update runs: ``model`` itself (single), a DDP wrapper (ddp) or ``model``
    sharded in place by FSDP2 (fsdp)."""
    if world.parallelism == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        device = next(model.parameters()).device
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if world.parallelism == "fsdp":
        from torch.distributed.fsdp import fully_shard

        check_shardable(model, world.size)
        for layer in decoder_layers(model):
            fully_shard(layer)
        fully_shard(model)
    return model


def reshard(model: torch.nn.Module) -> None:
    """Free FSDP's gathered weights before a training forward: a forward without gradient (generation,
    the sampling pass) leaves the root module's weights gathered, and a training forward on them
    would not route gradients back to the shards. Nothing to do outside FSDP."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside a DDP wrapper (FSDP2 shards in place: the model itself)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def several_ranks() -> bool:
    """True inside a process group of more than one rank."""
    return dist.is_initialized() and dist.get_world_size() > 1


def global_counts(*counts: int) -> tuple[int, ...]:
    """``counts`` summed over the ranks (unchanged without a process group of several ranks)."""
    if not several_ranks():
        return counts
    total = torch.tensor(counts, dtype=torch.float64, device=_collective_device())
    dist.all_reduce(total)
    return tuple(int(round(v)) for v in total.cpu().tolist())


def backward(loss: torch.Tensor) -> None:
    """``loss.backward()``, with the loss scaled by the world size under DDP / FSDP: both average the
    ranks' gradients, and the global normalisers already make the ranks' losses sum to the loss of
    the whole batch, so the average of world_size x (rank's gradient) is the whole batch's gradient."""
    if several_ranks():
        loss = loss * dist.get_world_size()
    loss.backward()


def gradient_norm(norm: torch.Tensor) -> float:
    """The value of ``clip_grad_norm_``'s total norm (a DTensor under FSDP: the full norm)."""
    full = getattr(norm, "full_tensor", None)
    return float(full() if full is not None else norm)


# ------------------------------------------------------------------------------- checkpoint states


def _full_options(load: bool = False):
    """Full (unsharded) state dicts on the CPU. With several ranks the full state lives on rank 0
    (the others get an empty dict) and loading broadcasts rank 0's to every rank's shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    if load:
        return StateDictOptions(full_state_dict=True, broadcast_from_rank0=several_ranks())
    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict as plain CPU tensors, gathered from the FSDP shards; every rank
    must call it, and with several ranks rank 0 holds it (the others get {}). Works on plain and
    DDP-wrapped models alike."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    reshard(model)  # the registered parameters are the shards again after a generation
    return get_model_state_dict(unwrap(model), options=_full_options())


def load_full_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a :func:`full_model_state` into ``model`` on every rank (rank 0's ``state`` is broadcast;
    each FSDP rank keeps its shard)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(unwrap(model), dict(state), options=_full_options(load=True))  # a copy: loading replaces its entries


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's whole state keyed by parameter names (gathered under FSDP; on rank 0)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.tensor import DTensor, Replicate

    def plain(value: Any) -> Any:  # a replicated scalar (AdamW's step after a broadcast load) as a tensor
        if isinstance(value, DTensor) and all(isinstance(p, Replicate) for p in value.placements):
            return value.to_local().cpu()
        return value

    state = get_optimizer_state_dict(unwrap(model), optimizer, options=_full_options())
    for entry in state.get("state", {}).values():
        for key in entry:
            entry[key] = plain(entry[key])
    return state


def load_full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a :func:`full_optimizer_state` (rank 0's, broadcast; each FSDP rank keeps its shard)."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    copied = {  # loading replaces the entries of the dicts it is given: the caller's stay as they were
        "state": {name: dict(entry) for name, entry in state.get("state", {}).items()},
        "param_groups": [dict(group) for group in state.get("param_groups", [])],
    }
    set_optimizer_state_dict(unwrap(model), optimizer, copied, options=_full_options(load=True))
