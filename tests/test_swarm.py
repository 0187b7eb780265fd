"""SAPO's swarm (trainer.strategy=swarm, rlbench/training/swarm.py): actors with their own policies
sharing rollouts. Shared groups keep their origin and are off-policy samples of their sender (pi_old =
the sender's sampling log-probs, never the receiver's); the draw is a function of the seed; with J = 0
an actor is the single-process run of its seed; bad settings are refused before anything loads."""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import ROOT, compose_config

from rlbench.algorithm import Algorithm
from rlbench.config import validate_config
from rlbench.errors import ConfigError
from rlbench.model import load_policy
from rlbench.rollout import make_engine
from rlbench.training.batch import collate
from rlbench.training.distributed import rank_stream_seed
from rlbench.training.step import TIMING_METRICS, behaviour_old_logp, make_step_context
from rlbench.training.swarm import SwarmPool, actor_config, check_swarm, draw_external, swarm_rollout

SMOKE = ["experiment=smoke", "trainer.steps=2", "eval.before_training=false", "logger=files", "trainer.save_model=false"]


@pytest.mark.parametrize("overrides, message", [
    (["trainer.strategy=swarm", "trainer.swarm.external=1"], "the swarm has one actor"),
    (["trainer.swarm.external=1"], "set trainer.strategy=swarm"),
])
def test_swarm_settings_are_refused_by_validation(make_cfg, overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(make_cfg("experiment=smoke", *overrides))
    validate_config(make_cfg("experiment=smoke", "trainer.strategy=swarm"))  # J = 0: one actor is a plain run


@pytest.mark.parametrize("overrides, message", [
    (["trainer.checkpoint_every=1"], "checkpoints and resume"),
    (["sampler=weighted"], "sampler=weighted"),
    (["trainer.stages=[{at: 2, rollout.n: 2}]"], "trainer.stages"),
])
def test_what_a_swarm_actor_cannot_do_yet_is_refused(make_cfg, overrides, message):
    # ddp / fsdp carry these (tests/test_distributed_resume.py); a swarm's actors are separate runs.
    with pytest.raises(ConfigError, match=f"trainer.strategy=swarm does not support .*{message}"):
        validate_config(make_cfg("experiment=smoke", "trainer.strategy=swarm", *overrides))


@pytest.mark.parametrize("overrides, message", [
    (["trainer.swarm.external=2"], r"leaves no local prompt: .* 2 - 2 = 0"),
    (["trainer.prompts_per_step=4", "trainer.swarm.external=3"], r"publish \(N-1\) \* I = 1 groups"),
    (["trainer.swarm.external=1", "rollout=dynamic_sampling"], "rollout=iid only"),
    (["trainer.swarm.external=1", "algorithm=gpg"], "needs on-policy data: loss 'reinforce'"),
])
def test_group_arithmetic_and_what_cannot_be_shared_are_refused(make_cfg, overrides, message):
    cfg = make_cfg("experiment=smoke", "trainer.strategy=swarm", *overrides)
    with pytest.raises(ConfigError, match=message):
        check_swarm(cfg, Algorithm.from_config(cfg.algorithm), actors=2)


def test_the_draw_is_a_function_of_seed_and_step_without_replacement():
    pool = [{"id": i} for i in range(6)]
    first = draw_external(pool, 3, seed=5, step=1)
    assert first == draw_external(pool, 3, seed=5, step=1)
    assert len({g["id"] for g in first}) == 3
    assert any(draw_external(pool, 3, seed=5, step=s) != first for s in range(2, 6))
    assert any(draw_external(pool, 3, seed=s, step=1) != first for s in range(6, 10))


def test_the_pool_gives_each_actor_the_others_lists_and_keeps_two_steps():
    store = dist.HashStore()
    pools = [SwarmPool(store, a, 3) for a in range(3)]
    received = [[], [], []]

    def steps(a):
        for step in range(1, 5):
            received[a].append(pools[a].exchange(step, [f"{a}@{step}"]))

    threads = [threading.Thread(target=steps, args=(a,)) for a in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert received[1] == [[[f"0@{s}"], [f"2@{s}"]] for s in range(1, 5)]
    assert store.num_keys() == 2 * 3  # steps 3 and 4 of each actor; 1 and 2 deleted once everyone read them


def test_an_actor_has_its_own_seed_and_folder(make_cfg):
    cfg = make_cfg("experiment=smoke", "trainer.strategy=swarm")
    zero, one = actor_config(cfg, 0), actor_config(cfg, 1)
    assert (zero.seed, Path(zero.output_dir).name) == (cfg.seed, "actor0")  # actor 0: the single run of seed
    assert (one.seed, Path(one.output_dir).name) == (rank_stream_seed(cfg.seed, 1), "actor1")
    assert one.run_name.endswith(f"-s{one.seed}")


def actor(tmp_path, index: int, store, external: int = 1):
    """Actor ``index`` of two (a step context on the tiny model) with its swarm rollout on ``store``."""
    cfg = actor_config(compose_config(["experiment=smoke", "trainer.strategy=swarm", f"trainer.swarm.external={external}"],
                                      tmp_path), index)
    model, tokenizer = load_policy(cfg.model, device=torch.device("cpu"), dtype=torch.float32, seed=cfg.seed,
                                   cache_dir=cfg.cache_dir)
    ctx = make_step_context(cfg, Algorithm.from_config(cfg.algorithm), model, tokenizer,
                            make_engine(cfg.rollout, model, tokenizer, torch.device("cpu")), torch.device("cpu"))
    ctx.policy_version = 3 + index  # versions told apart: the receiver's is not the sender's
    return ctx, swarm_rollout(ctx, cfg, SwarmPool(store, index, 2))


def exchange(actors, problems):
    """One step of both actors, each in its own thread (the pool blocks until the other published)."""
    results = [None, None]

    def step(i):
        results[i] = actors[i][1].rollout(problems[i], None)

    threads = [threading.Thread(target=step, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return results


def test_shared_groups_carry_their_origin_and_are_never_pi_old_samples_of_the_receiver(tmp_path):
    from rlbench.dataset.base import Problem

    store = dist.HashStore()
    actors = [actor(tmp_path / "a", 0, store), actor(tmp_path / "b", 1, store)]
    problems = [[Problem(f"p{a}{i}", f"{a} + {i} =", str(a + i)) for i in range(2)] for a in range(2)]
    (graded, metrics), _ = exchange(actors, problems)
    import pickle

    published = pickle.loads(store.get("step1/actor1"))  # what actor 1 sent: its one local group (I = 2 - 1)
    assert [g["problem"].uid for g in published] == ["p10"]
    assert [p.uid for p in graded.problems] == ["p00", "p10"]  # I own groups first, then J shared ones
    assert graded.group_ids == [0, 1]
    own, shared = graded.groups
    assert all(c.behaviour == "policy" and c.off_policy is None for c in own)
    sent = published[0]["responses"]
    for c, r in zip(shared, sent, strict=True):
        assert c.behaviour == "swarm:actor1" and c.policy_version == 4  # the sender's version, not the receiver's 3
        assert c.off_policy == [1] * len(r["ids"]) and c.response_ids == r["ids"]
        assert c.behaviour_logprobs == r["logprobs"]
    receiver = actors[0][0]
    assert shared[0].prompt_ids == tuple(receiver.sampler.encode([graded.problems[1]])[0])  # the receiver's prompt
    # pi_old on the shared tokens is the sender's sampling log-prob, whatever the receiver recomputes
    batch = collate(graded.groups, receiver.tokenizer.pad_token_id, current_version=receiver.policy_version)
    recomputed = torch.zeros_like(batch.behaviour_logp)
    old = behaviour_old_logp(batch, recomputed)
    rows = slice(len(own), len(own) + len(shared))
    mask = batch.response_mask[rows] > 0
    expected = torch.nn.utils.rnn.pad_sequence([torch.tensor(r["logprobs"]) for r in sent], batch_first=True)
    assert torch.equal(old[rows][mask], expected[:, :old.shape[1]][mask].to(old.dtype))
    assert torch.equal(old[: len(own)], recomputed[: len(own)])
    assert metrics["swarm_external_reward_mean"] == float(graded.outcome[len(own):].mean())
    assert "swarm_retokenise_mismatch" in metrics


def test_the_exchange_is_deterministic_under_a_seed(tmp_path):
    from rlbench.dataset.base import Problem

    problems = [[Problem(f"p{a}{i}", f"{a} + {i} =", str(a + i)) for i in range(4)] for a in range(2)]
    runs = []
    for name in ("first", "second"):
        store = dist.HashStore()
        actors = [actor(tmp_path / name / "a", 0, store, external=2), actor(tmp_path / name / "b", 1, store, external=2)]
        runs.append([(g.problems, [[(c.response_ids, c.logprobs) for c in group] for group in g.groups], g.rewards.tolist())
                     for g, _ in exchange(actors, problems)])
    assert runs[0] == runs[1]


def actor_metrics(folder: Path) -> list[dict]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in TIMING_METRICS} for row in rows]


@pytest.mark.slow
def test_without_shared_groups_an_actor_is_the_single_run_of_its_seed(tmp_path, monkeypatch):
    from rlbench.runner import run

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    run(compose_config([*SMOKE, "trainer.strategy=swarm"], tmp_path / "swarm"))  # actor 1 of 2, J = 0
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    run(compose_config([*SMOKE, f"seed={rank_stream_seed(0, 1)}"], tmp_path / "single"))
    assert actor_metrics(tmp_path / "swarm" / "actor1") == actor_metrics(tmp_path / "single")
    swarm = json.loads((tmp_path / "swarm" / "actor1" / "summary.json").read_text())
    single = json.loads((tmp_path / "single" / "summary.json").read_text())
    assert swarm["pass_at_1_after"] == single["pass_at_1_after"]


@pytest.mark.slow
def test_torchrun_two_actors_share_rollouts_from_the_command_line(tmp_path):
    """torchrun -m rlbench.cli with 2 actors, I = J = 1: each actor writes its run folder and trains on
    one own group and one of the other actor's (half of its tokens off-policy)."""
    out = tmp_path / "swarm"
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("torchrun")), "--nproc_per_node", "2", "-m", "rlbench.cli", *SMOKE,
         "eval.n=1", "eval.k=[1]", "eval.limit=1", "trainer.strategy=swarm", "trainer.swarm.external=1",
         f"hydra.run.dir={out}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "status.json").read_text())["status"] == "finished"
    for me, other in ((0, 1), (1, 0)):
        rows = actor_metrics(out / f"actor{me}")
        assert len(rows) == 2
        for row in rows:
            assert row[f"responses_swarm:actor{other}"] == 2.0 and row["responses_policy"] == 2.0
            assert row["off_policy_token_fraction"] == 0.5  # every smoke response has max_new_tokens tokens
        summary = json.loads((out / f"actor{me}" / "summary.json").read_text())
        assert summary["seed"] == rank_stream_seed(0, me)
