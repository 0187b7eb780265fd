"""Multi-process training (rlbench/training/distributed.py): 2 ranks (gloo on CPU, spawned here)
give the same update as one process on the whole batch, for every aggregation mode, under DDP and
FSDP2; groups are never split across ranks; the checkpoint state helpers round-trip under FSDP, and
both ranks write one checkpoint (sharded under FSDP) and agree on a stop signal."""

import os
import signal
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from filelock import FileLock

from rlbench.algorithm.registry import AGGREGATIONS
from rlbench.errors import ConfigError
from rlbench.training.batch import collate
from rlbench.training.forward import batch_outputs
from rlbench.training.distributed import (
    World,
    check_shardable,
    check_parallelism,
    full_model_state,
    full_optimizer_state,
    global_counts,
    load_full_model_state,
    load_full_optimizer_state,
    rank_stream_seed,
    wrap_model,
)
from rlbench.training.checkpoint import load_sharded, read_checkpoint, save_checkpoint, save_sharded, state_file
from rlbench.training.prompt_stats import PromptStatsStore
from rlbench.training.interrupt import Interrupted, StopSignals
from rlbench.training.update import standard_update

from test_curricula import PROBLEMS, graded
from conftest import algorithm_from
from test_trainer import RecordingOptimizer, algo, completions, tiny_lm

AGGREGATION_MODES = sorted(AGGREGATIONS.names())
GROUPS, N = 4, 3  # 4 prompts x 3 responses; each of 2 ranks trains 2 whole groups
UPDATE = dict(micro_batch_size=2, max_grad_norm=None, temperature=1.0, norm_length=6)


# the NLL of the correct responses (algorithm.positive_nll_coef): every other response correct; its counts are global too
CORRECT = torch.arange(GROUPS * N) % 2 == 0
POSITIVE_NLL = "token_mean+positive_nll"


def algorithm_of(case: str):
    if case == POSITIVE_NLL:
        return algorithm_from({"name": "t", "advantage": {"name": "grpo"}, "loss": {"name": "ppo_clip"},
                               "aggregation": {"name": "token_mean"}, "positive_nll_coef": 0.1})
    return algo(case)


def rewards_of(size: int) -> torch.Tensor:
    return torch.rand(size, generator=torch.Generator().manual_seed(7))


def group_batch(algorithm, groups, rewards):
    """The batch of ``groups`` with the advantages computed from these groups alone."""
    batch = collate(groups, pad_token_id=0)
    batch.rewards = rewards
    batch.advantages = algorithm.compute_advantages(batch.rewards, batch.group_index, batch.response_mask)
    return batch


def full_gradient(recorded, params) -> torch.Tensor:
    """The recorded gradient of the single optimizer step, flattened (DTensor shards gathered)."""
    return torch.cat([
        (g.full_tensor() if hasattr(g, "full_tensor") else g).reshape(-1) for g in recorded.steps[0]
    ])


def one_process_gradient(aggregation: str) -> torch.Tensor:
    algorithm = algorithm_of(aggregation)
    groups = completions(0, groups=GROUPS, n=N)
    batch = group_batch(algorithm, groups, rewards_of(GROUPS * N))
    batch.correct = CORRECT
    model = tiny_lm(0)
    recorded = RecordingOptimizer(model)
    standard_update(model, recorded, batch, algorithm, **UPDATE)
    return full_gradient(recorded, model.parameters())


def rank_worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        groups = completions(0, groups=GROUPS, n=N)
        rewards = rewards_of(GROUPS * N)
        results = {}
        for strategy in ("ddp", "fsdp"):
            world = World(rank, world_size, strategy)
            own = world.shard(list(range(GROUPS)))  # whole groups: this rank's prompts
            rows = [g * N + k for g in own for k in range(N)]
            for aggregation in [*AGGREGATION_MODES, POSITIVE_NLL]:
                algorithm = algorithm_of(aggregation)
                batch = group_batch(algorithm, [groups[g] for g in own], rewards[rows])
                batch.correct = CORRECT[rows]
                model = wrap_model(tiny_lm(0), world)
                recorded = RecordingOptimizer(model)  # holds the parameters as the run's optimizer does
                batch_outputs(model, batch, 2, 1.0)  # a forward without gradient first (the sampling pass)
                standard_update(model, recorded, batch, algorithm, **UPDATE)
                results[(strategy, aggregation)] = full_gradient(recorded, model.parameters())
            results[(strategy, "rows")] = rows
        results["counts"] = global_counts(rank + 1, 10)
        # checkpoint helpers: full state from FSDP ranks, loaded into a freshly sharded model
        world = World(rank, world_size, "fsdp")
        model = wrap_model(tiny_lm(0), world)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        batch = group_batch(algo("token_mean"), [groups[g] for g in world.shard(list(range(GROUPS)))],
                            rewards[[g * N + k for g in world.shard(list(range(GROUPS))) for k in range(N)]])
        standard_update(model, optimizer, batch, algo("token_mean"), **UPDATE)
        model_state, optimizer_state = full_model_state(model), full_optimizer_state(model, optimizer)
        fresh = wrap_model(tiny_lm(1), world)
        fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        load_full_model_state(fresh, model_state)
        load_full_optimizer_state(fresh, fresh_optimizer, optimizer_state)
        results["state"] = (model_state, optimizer_state)
        results["reloaded"] = (full_model_state(fresh), full_optimizer_state(fresh, fresh_optimizer))
        # a checkpoint written by both ranks: per-rank state files and sharded model + optimizer
        saved = save_checkpoint(out_dir, 1, {state_file(rank): {"rank": rank}}, {"config": {}}, world=world,
                                write_shards=lambda folder: save_sharded(model, optimizer, folder))
        sharded = wrap_model(tiny_lm(1), world)
        sharded_optimizer = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
        load_sharded(sharded, sharded_optimizer, saved.path)
        results["checkpoint"] = (read_checkpoint(saved.path).manifest, world.gather([saved.manifest]))
        results["sharded_reloaded"] = (full_model_state(sharded), full_optimizer_state(sharded, sharded_optimizer))
        results["rank1_state"] = torch.load(saved.path / state_file(1), weights_only=True)
        # a stop signal that reached rank 1 only stops both ranks at the same step boundary
        stop = StopSignals()
        stop.signum = signal.SIGINT if rank == 1 else None
        try:
            stop.raise_if_requested(world)
            stopped = None
        except Interrupted as interrupted:
            stopped = (interrupted.signum, interrupted.at_step_boundary)
        results["stopped"] = world.gather([stopped])
        # prompt statistics: each rank observes its groups, every rank's store counts the whole step
        store = PromptStatsStore()
        store.observe(2, stats_groups(world.shard(list(range(GROUPS)))), world)
        results["stats"] = world.gather([store.state_dict()])
        if rank == 0:
            torch.save(results, os.path.join(out_dir, "rank0.pt"))
    finally:
        dist.destroy_process_group()


def stats_groups(indices):
    """Graded groups of PROBLEMS[i] for i in ``indices``: i + 1 responses of length i + 2, i of them correct."""
    return graded([PROBLEMS[i] for i in indices], [[i + 2] * (i + 1) for i in indices],
                  [[1] * i + [0] for i in indices])


SPAWN_TRIES = 3  # a rank killed by a signal is tried again (see two_ranks); an exception in a rank is not


def spawn_two_ranks(out_dir: str) -> dict:
    """Run rank_worker on 2 spawned ranks and return rank 0's results. Under a loaded CPU a rank has been
    seen to die by SIGABRT from inside torch's C++ ("terminate called without an active exception", no
    Python frame; 2 in ~40 runs of this fixture beside other torch processes, none on an idle machine):
    such a death is tried again, at most SPAWN_TRIES times; a Python exception in a rank fails at once."""
    for attempt in range(1, SPAWN_TRIES + 1):
        init_file = os.path.join(out_dir, f"rendezvous{attempt}")
        try:
            mp.spawn(rank_worker, args=(2, init_file, out_dir), nprocs=2, join=True)
            return torch.load(os.path.join(out_dir, "rank0.pt"), weights_only=False)
        except mp.ProcessExitedException as died:
            if died.signal_name is None or attempt == SPAWN_TRIES:
                raise
            warnings.warn(f"two_ranks: attempt {attempt} lost a rank ({died}); trying again")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, worker_id):
    """The two ranks' results, computed once per test session: under pytest-xdist the first worker to
    arrive runs the ranks and the other reads its file (the xdist recipe for an expensive fixture), so
    the CI's two workers do not each spawn two more torch processes."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if worker_id == "master":
        with tempfile.TemporaryDirectory() as out_dir:
            return spawn_two_ranks(out_dir)
    shared = tmp_path_factory.getbasetemp().parent / "two_ranks.pt"
    with FileLock(str(shared) + ".lock"):
        if shared.is_file():
            return torch.load(shared, weights_only=False)
        with tempfile.TemporaryDirectory() as out_dir:
            results = spawn_two_ranks(out_dir)
        torch.save(results, str(shared) + ".tmp")
        os.replace(str(shared) + ".tmp", shared)  # only a complete result is ever read by the other worker
        return results


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("aggregation", [*AGGREGATION_MODES, POSITIVE_NLL])
def test_two_ranks_give_the_one_process_update(two_ranks, strategy, aggregation):
    """Each rank trains half of the groups; the normalisers are global and the gradient is reduced,
    so the update equals one process's update on the whole batch."""
    expected = one_process_gradient(aggregation)
    got = two_ranks[(strategy, aggregation)]
    assert expected.abs().max() > 1e-3  # a real gradient, not zeros on both sides
    assert torch.allclose(got, expected, atol=1e-6, rtol=1e-6), (got - expected).abs().max()


@pytest.mark.slow
def test_both_ranks_write_one_checkpoint_with_sharded_state_that_loads_back(two_ranks):
    manifest, returned = two_ranks["checkpoint"]
    assert returned == [manifest, manifest]  # every rank returns once the manifest is written
    assert (manifest["parallelism"], manifest["world_size"]) == ("fsdp", 2) and len(manifest["rank_write_seconds"]) == 2
    assert {"state.pt", "state.rank1.pt", "sharded/.metadata", "sharded/__0_0.distcp", "sharded/__1_0.distcp"} == set(
        manifest["files"])  # no rank wrote the whole model
    assert two_ranks["rank1_state"] == {"rank": 1}
    (model_state, optimizer_state), (model_back, optimizer_back) = two_ranks["state"], two_ranks["sharded_reloaded"]
    for key, value in model_state.items():
        assert torch.equal(model_back[key], value), key
    for name, state in optimizer_state["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(optimizer_back["state"][name][key]), torch.as_tensor(value)), (name, key)


@pytest.mark.slow
def test_every_rank_counts_the_whole_steps_prompt_statistics(two_ranks):
    alone = PromptStatsStore()
    alone.observe(2, stats_groups(range(GROUPS)))
    assert two_ranks["stats"] == [alone.state_dict(), alone.state_dict()]
    assert alone.get("3").attempts == 4 and alone.get("3").correct == 3


@pytest.mark.slow
def test_a_signal_on_one_rank_stops_every_rank(two_ranks):
    assert two_ranks["stopped"] == [(signal.SIGINT, True), (signal.SIGINT, True)]


@pytest.mark.slow
def test_ranks_hold_whole_groups_and_counts_are_summed(two_ranks):
    assert two_ranks[("ddp", "rows")] == [0, 1, 2, 3, 4, 5]  # rank 0: groups 0 and 1, all their responses
    assert two_ranks["counts"] == (1 + 2, 20)


@pytest.mark.slow
def test_full_states_round_trip_under_fsdp(two_ranks):
    (model_state, optimizer_state), (model_back, optimizer_back) = two_ranks["state"], two_ranks["reloaded"]
    reference = tiny_lm(0).state_dict()
    assert set(model_state) == set(reference)
    assert any(not torch.equal(model_state[k], reference[k]) for k in reference)  # the step moved it
    for key, value in model_state.items():
        assert torch.equal(model_back[key], value), key
    for name, state in optimizer_state["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(optimizer_back["state"][name][key]), torch.as_tensor(value)), (name, key)


def test_full_states_work_in_one_process():
    model = tiny_lm(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    fresh = tiny_lm(1)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    load_full_model_state(fresh, full_model_state(model))
    load_full_optimizer_state(fresh, fresh_optimizer, full_optimizer_state(model, optimizer))
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    assert torch.equal(fresh_optimizer.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])


def test_a_group_is_never_split_and_the_world_size_must_divide_the_prompts():
    prompts = list("abcdef")
    assert [World(r, 3, "ddp").shard(prompts) for r in range(3)] == [["a", "b"], ["c", "d"], ["e", "f"]]
    with pytest.raises(ConfigError, match="world size 4 does not divide the 6 prompts"):
        World(0, 4, "ddp").shard(prompts)


def test_evaluation_shards_are_padded_to_one_length():
    items = list(range(5))
    shards = [World(r, 2, "fsdp").shard_padded(items) for r in range(2)]
    assert shards == [([0, 2, 4], 3), ([1, 3, 4], 2)]  # rank 1 repeats the last problem, counts 2 real ones


def test_rank_zero_samples_the_single_process_stream():
    assert rank_stream_seed(5, 0) == 5
    assert len({rank_stream_seed(5, r) for r in range(8)}) == 8


def test_bad_strategies_are_refused_before_loading(monkeypatch):
    grpo = algo("token_mean")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="world size 3 does not divide trainer.prompts_per_step=8"):
        check_parallelism("ddp", 8, grpo, "iid")
    with pytest.raises(ConfigError, match="trainer.parallelism=single"):
        check_parallelism("single", 9, grpo, "iid")
    with pytest.raises(ConfigError, match="rollout=dynamic_sampling"):
        check_parallelism("fsdp", 9, grpo, "dynamic_sampling")
    with pytest.raises(ConfigError, match="unknown"):
        check_parallelism("deepspeed", 9, grpo, "iid")
    check_parallelism("ddp", 9, grpo, "iid")


def test_samplers_and_stages_run_on_several_ranks_when_the_stages_batches_split(make_cfg, monkeypatch):
    from rlbench.validation import validate_config

    monkeypatch.setenv("WORLD_SIZE", "2")
    common = ["experiment=smoke", "trainer.parallelism=ddp", "trainer.steps=3", "prompt_sampler=hard_focus",
              "trainer.checkpoint_every=1"]
    validate_config(make_cfg(*common, "trainer.stages=[{at:2,trainer.prompts_per_step:4}]"))
    with pytest.raises(ConfigError, match="from trainer.stages at step 3: the world size 2 does not divide "
                                          "trainer.prompts_per_step=3"):
        validate_config(make_cfg(*common, "trainer.stages=[{at:3,trainer.prompts_per_step:3}]"))
    with pytest.raises(ConfigError, match="does not support trainer.max_staleness"):
        validate_config(make_cfg("experiment=smoke", "trainer.parallelism=fsdp", "trainer.max_staleness=1"))


def test_fsdp_refuses_a_model_too_small_to_shard():
    check_shardable(tiny_lm(0), 2)
    with pytest.raises(ConfigError, match="too small to shard over 4 ranks.*fewer than 4 rows"):
        check_shardable(torch.nn.Sequential(torch.nn.Linear(8, 3), torch.nn.Linear(3, 8)), 4)


def before_rows(out):
    """The evaluation before training (passk.csv rows and per-problem counts)."""
    rows = [line for line in (out / "eval" / "passk.csv").read_text().splitlines() if line.endswith(",before")]
    problems = [line for line in (out / "eval" / "problems.csv").read_text().splitlines() if "before" in line]
    return rows, problems


@pytest.mark.slow
def test_torchrun_two_processes_write_one_run_with_the_evaluation_of_one_process(tmp_path):
    """torchrun -m rlbench.cli with 2 ranks (gloo): rank 0 alone writes the run, and the sharded,
    gathered evaluation before training is the one a single process computes (per-problem streams)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from conftest import ROOT, compose_config

    from rlbench.runner import run

    common = ["experiment=smoke", "logger=files", "trainer.steps=1", "trainer.save_model=false"]
    two = tmp_path / "two"
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("torchrun")), "--nproc_per_node", "2", "-m", "rlbench.cli", *common,
         "trainer.parallelism=ddp", f"hydra.run.dir={two}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((two / "summary.json").read_text())
    assert (summary["parallelism"], summary["world_size"]) == ("ddp", 2)
    assert json.loads((two / "status.json").read_text())["status"] == "finished"
    assert len((two / "metrics.jsonl").read_text().splitlines()) == 1  # one writer: one line per step
    one = tmp_path / "one"
    run(compose_config(common, one))
    assert before_rows(two) == before_rows(one)
    assert before_rows(one)[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fsdp_with_one_rank_on_cuda_gives_the_single_gpu_update():
    """NCCL, one GPU: FSDP2's update equals the plain model's (a world of one rank, no torchrun)."""
    from rlbench.training.distributed import close_world, init_world

    world = init_world("fsdp", torch.device("cuda"))
    try:
        algorithm = algo("token_mean")
        batch = collate(completions(0, groups=GROUPS, n=N), pad_token_id=0, device="cuda")
        batch.rewards = rewards_of(GROUPS * N).cuda()
        batch.advantages = algorithm.compute_advantages(batch.rewards, batch.group_index, batch.response_mask)
        grads = []
        for wrapped in (tiny_lm(0).cuda(), wrap_model(tiny_lm(0).cuda(), world)):
            recorded = RecordingOptimizer(wrapped)
            standard_update(wrapped, recorded, batch, algorithm, **UPDATE)
            grads.append(full_gradient(recorded, None).cpu())
        assert torch.allclose(grads[0], grads[1], atol=1e-4, rtol=1e-3)
    finally:
        close_world(world)
