"""SAPO's swarm (trainer.parallelism=swarm, rlbench/training/swarm.py): actors with their own policies
sharing rollouts. Shared groups keep their origin; pi_old of their tokens is the receiver's own forward
pass (the paper's rule, the default) or, with old_logprobs=sender, the sender's sampling log-probs; the draw is a function of the seed; with J = 0
an actor is the single-process run of its seed; bad settings are refused before anything loads. The
actors agree through the pool on stops and on the step a resume continues from, an actor's prompt
sampler counts its own groups only, and a swarm stopped by a signal on one actor and resumed equals
the uninterrupted swarm (docs/scaling.md)."""

import json
import pickle
import re
import shutil
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import compose_config

from conftest import algorithm_from
from rlbench.validation import validate_config
from rlbench.errors import ConfigError
from rlbench.model import load_policy
from rlbench.rollout import make_engine
from rlbench.training import checkpoint
from rlbench.training.batch import collate
from rlbench.training.distributed import rank_stream_seed
from rlbench.training.step import TIMING_METRICS, behaviour_old_logp, make_step_context
from rlbench.config.typed import typed_config
from rlbench.reward.graders import training_grader
from rlbench.training.checkpoint import actor_folder, checkpoint_home
from rlbench.training.swarm import (
    LaggedStops, SwarmPool, actor_config, agreed_resume_step, check_resume_swarm, check_swarm, draw_external, own_groups,
    swarm_manifest, swarm_rollout,
)

SMOKE = ["experiment=smoke", "trainer.steps=2", "eval.before_training=false", "logger=files", "trainer.save_model=false"]


@pytest.mark.parametrize("overrides, message", [
    (["trainer.parallelism=swarm", "trainer.swarm.external=1"], "the swarm has one actor"),
    (["trainer.swarm.external=1"], "set trainer.parallelism=swarm"),
])
def test_swarm_settings_are_refused_by_validation(make_cfg, overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(make_cfg("experiment=smoke", *overrides))
    validate_config(make_cfg("experiment=smoke", "trainer.parallelism=swarm"))  # J = 0: one actor is a plain run


def test_a_swarm_actor_checkpoints_and_takes_samplers_and_stages_but_not_staleness(make_cfg):
    # every actor is a whole run: its own checkpoints, prompt sampler and stages (tests below and
    # test_torchrun_swarm_stopped_killed_and_resumed_gives_the_uninterrupted_run)
    validate_config(make_cfg("experiment=smoke", "trainer.parallelism=swarm", "trainer.checkpoint_every=1", "prompt_sampler=weighted",
                             "trainer.stages=[{at: 2, rollout.n: 4}]"))
    with pytest.raises(ConfigError, match="trainer.parallelism=swarm does not support trainer.max_staleness"):
        validate_config(make_cfg("experiment=smoke", "trainer.parallelism=swarm", "trainer.max_staleness=0"))


@pytest.mark.parametrize("overrides, message", [
    (["trainer.swarm.external=2"], r"leaves no local prompt: .* 2 - 2 = 0"),
    (["trainer.prompts_per_step=4", "trainer.swarm.external=3"], r"publish \(N-1\) \* I = 1 groups"),
    (["trainer.swarm.external=1", "rollout=dynamic_sampling"], "rollout=iid only"),
    (["trainer.swarm.external=1", "algorithm=gpg"], "needs on-policy data: loss 'reinforce'"),
    # every stage's batch is checked too: a stage that shrinks the step leaves no own prompt, or too few shared
    (["trainer.swarm.external=1", "trainer.stages=[{at: 2, trainer.prompts_per_step: 1}]"],
     r"from trainer.stages at step 2: trainer.swarm.external=1 leaves no local prompt"),
    (["trainer.prompts_per_step=4", "trainer.swarm.external=2", "trainer.stages=[{at: 2, trainer.prompts_per_step: 3}]"],
     r"from trainer.stages at step 2: .* publish \(N-1\) \* I = 1 groups"),
    # a heterogeneous swarm: one model per actor, each one that can load; another tokenizer has no sender log-probs
    (["trainer.swarm.external=1", "trainer.swarm.models=[tiny]"], "lists 1 models, one per actor, but the swarm has 2"),
    (["trainer.swarm.external=1", "trainer.swarm.models=[tiny,no_such_model]"], "'no_such_model' is neither a model option"),
    (["trainer.swarm.external=1", "trainer.swarm.old_logprobs=sender", "trainer.swarm.models=[null,{tiny:{vocab_size:320}}]"],
     "old_logprobs=sender .* mixes models"),
    (["trainer.swarm.external=1", "trainer.swarm.models=[null,{tiny:{vocab_size:320}}]", "algorithm.sampling_correction={cap:2.0}"],
     "sampling_correction .* mixes models"),
    (["trainer.swarm.lag=1"], "trainer.swarm.lag=1 delays the groups the actors share, but they share none"),
    (["trainer.swarm.pool_filter=zero_advantage"], "pool_filter=zero_advantage filters the groups the actors share"),
])
def test_group_arithmetic_and_what_cannot_be_shared_are_refused(make_cfg, overrides, message):
    cfg = make_cfg("experiment=smoke", "trainer.parallelism=swarm", *overrides)
    with pytest.raises(ConfigError, match=message):
        check_swarm(typed_config(cfg), algorithm_from(cfg.algorithm), actors=2)


def test_the_swarm_settings_outside_a_swarm_are_refused_and_one_model_everywhere_is_no_mix(make_cfg):
    for setting in ("trainer.swarm.lag=1", "trainer.swarm.models=[tiny]", "trainer.swarm.pool_filter=zero_advantage"):
        cfg = make_cfg("experiment=smoke", setting)
        with pytest.raises(ConfigError, match=r"set trainer.parallelism=swarm \(under torchrun\) or trainer.swarm"):
            check_swarm(typed_config(cfg), algorithm_from(cfg.algorithm), actors=2)
    # the run's model named twice (null and its option) is not a mixed swarm: old_logprobs=sender stays allowed
    cfg = make_cfg("experiment=smoke", "trainer.parallelism=swarm", "trainer.swarm.external=1", "trainer.swarm.old_logprobs=sender",
                   "trainer.swarm.models=[null,tiny]", "trainer.swarm.lag=1")
    check_swarm(typed_config(cfg), algorithm_from(cfg.algorithm), actors=2)


def test_each_actor_gets_its_listed_model(make_cfg, tmp_path):
    cfg = make_cfg("experiment=smoke", "trainer.parallelism=swarm",
                   f"trainer.swarm.models=[null,{{tiny:{{vocab_size:320}}}},smollm2_135m,{tmp_path}]")
    models = [actor_config(cfg, a).model for a in range(4)]
    assert models[0] == cfg.model  # null: the run's model
    assert models[1].tiny.vocab_size == 320 and models[1].tiny.hidden_size == cfg.model.tiny.hidden_size  # fields over it
    assert (models[2].name, models[2].source, models[2].get("lora")) == ("smollm2_135m", "gguf_package", cfg.model.get("lora"))
    assert (models[3].source, models[3].path) == ("path", str(tmp_path))  # a folder: model=checkpoint
    assert actor_config(make_cfg("experiment=smoke", "trainer.parallelism=swarm"), 1).model == cfg.model  # no list


def test_the_draw_is_a_function_of_seed_and_step_without_replacement():
    pool = [{"id": i} for i in range(6)]
    first = draw_external(pool, 3, seed=5, step=1)
    assert first == draw_external(pool, 3, seed=5, step=1)
    assert len({g["id"] for g in first}) == 3
    assert any(draw_external(pool, 3, seed=5, step=s) != first for s in range(2, 6))
    assert any(draw_external(pool, 3, seed=s, step=1) != first for s in range(6, 10))


def together(*calls, timeout=300):
    """Run ``calls`` at once, each in its own thread (the pool blocks until every actor is there);
    their results in order (an exception raised is the result)."""
    results = [None] * len(calls)

    def call(i):
        try:
            results[i] = calls[i]()
        except Exception as err:  # noqa: BLE001 - the test looks at it
            results[i] = err

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    return results


@pytest.mark.parametrize("lag", [0, 2])
def test_the_pool_gives_each_actor_the_others_lists_of_step_minus_lag_and_keeps_2_plus_2_lag_steps(lag):
    store = dist.HashStore()
    pools = [SwarmPool(store, a, 3) for a in range(3)]
    steps = range(1, 9)
    received = together(*[lambda a=a: [pools[a].exchange(step, [f"{a}@{step}"], lag) for step in steps] for a in range(3)],
                        timeout=60)
    assert received[1] == [None if s <= lag else [[f"0@{s - lag}"], [f"2@{s - lag}"]] for s in steps]
    assert store.num_keys() == (2 + 2 * lag) * 3  # the last 2 + 2 lag steps of each actor; the earlier ones read by all


def test_with_a_lag_the_actors_stop_after_the_same_step_lag_steps_after_a_signal():
    """trainer.swarm.lag = 1: a SIGINT (2) that reached actor 1 after step 2 stops both after step 3, each
    deciding from the signals published after step 2; resumed at step 3, the rounds before are not read."""
    store = dist.HashStore()
    stops = [LaggedStops(SwarmPool(store, a, 2), 1) for a in range(2)]
    decided = together(*[lambda a=a: [stops[a].max_over_ranks(2 if (a, step) == (1, 2) else 0) for step in range(1, 6)]
                         for a in range(2)], timeout=60)
    assert decided == [[0, 0, 2, 0, 0]] * 2
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=5))  # a read of a round before the resume would wait for a key never set
    resumed = [LaggedStops(SwarmPool(store, a, 2), 1) for a in range(2)]
    for r in resumed:
        r.resume_at(3)
    decided = together(*[lambda a=a: [resumed[a].max_over_ranks(15 if (a, step) == (1, 4) else 0) for step in range(4, 7)]
                         for a in range(2)], timeout=60)
    assert decided == [[0, 15, 0]] * 2


def test_the_actors_agree_through_the_pool_on_a_stop_signal_and_gather_in_actor_order():
    store = dist.HashStore()
    pools = [SwarmPool(store, a, 3) for a in range(3)]

    def rounds(a):  # what the loop does after each step: a stop signal (SIGINT = 2) reached actor 1 after step 3
        stops = [pools[a].max_over_ranks(2 if (a, step) == (1, 3) else 0) for step in range(1, 5)]
        gathered = pools[a].gather([f"{a}"])
        pools[a].barrier()
        return stops, gathered

    for stops, gathered in together(*[lambda a=a: rounds(a) for a in range(3)], timeout=60):
        assert stops == [0, 0, 2, 0] and gathered == ["0", "1", "2"]
    assert store.num_keys() == 2 * 3  # each actor's last two rounds


def test_a_swarm_resumes_from_the_newest_step_every_actor_has_a_checkpoint_of(tmp_path, monkeypatch):
    """Actor 1 was killed while writing step 4's checkpoint: the swarm resumes both actors at step 2;
    with no step in common every actor refuses, naming each one's steps."""
    from omegaconf import OmegaConf

    from rlbench.runner import resume_point

    monkeypatch.setenv("WORLD_SIZE", "2")
    swarm = compose_config([*SMOKE, "trainer.steps=4", "trainer.parallelism=swarm", "trainer.swarm.external=1",
                            f"resume={tmp_path}"], tmp_path)
    actors = [actor_config(swarm, a) for a in range(2)]
    resolved = [OmegaConf.to_container(cfg, resolve=True) for cfg in actors]
    for a, steps in ((0, (2, 4)), (1, (1, 2))):
        for step in steps:
            checkpoint.save_checkpoint(actors[a].output_dir, step, {"state.pt": {"step": step}},
                                       {"config": checkpoint.comparable_config(resolved[a]), **swarm_manifest(2, 1)})

    def resume_all():
        store = dist.HashStore()
        return together(*[lambda a=a: resume_point(actors[a], resolved[a], SwarmPool(store, a, 2)) for a in range(2)])

    assert [saved.step for saved in resume_all()] == [2, 2]
    shutil.rmtree(Path(actors[1].output_dir) / "checkpoints" / "step_000002")
    for refused in resume_all():
        assert isinstance(refused, ConfigError)
        assert "no checkpoint at a common step (actor 0: [2, 4]; actor 1: [1])" in str(refused)
    assert agreed_resume_step([[1, 2, 3], [2, 3], [3, 4]]) == 3


@pytest.mark.parametrize("actors, external, message", [
    (3, 1, "written by a swarm of 2 actors sharing trainer.swarm.external=1 groups, but this run has 3 actors"),
    (2, 0, "--nproc_per_node 2 and trainer.swarm.external=1"),
])
def test_a_swarm_resumes_only_with_the_actors_and_shared_groups_that_wrote_it(actors, external, message):
    check_resume_swarm(swarm_manifest(2, 1), Path("ckpt"), 2, 1)
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_resume_swarm(swarm_manifest(2, 1), Path("ckpt"), actors, external)
    with pytest.raises(ConfigError, match="not written by a swarm actor"):
        check_resume_swarm({"strategy": "ddp", "world_size": 2}, Path("ckpt"), 2, 1)


def test_resume_of_a_swarm_folder_reads_actor_zeros_overrides(tmp_path):
    from rlbench.cli import resume_arguments

    checkpoint.save_checkpoint(actor_folder(tmp_path, 0), 2, {"state.pt": {}}, {"overrides": ["trainer.parallelism=swarm"]})
    assert checkpoint_home(tmp_path) == actor_folder(tmp_path, 0)
    assert resume_arguments([f"resume={tmp_path}"]) == ["trainer.parallelism=swarm", f"resume={tmp_path.resolve()}",
                                                        f"hydra.run.dir={tmp_path.resolve()}"]


def test_an_actors_prompt_statistics_count_its_own_groups_only(make_cfg):
    """A shared group answers another actor's problem (arith generates each actor's set from its seed,
    so the same uid is another problem) with another policy: the sampler's statistics leave it out."""
    from rlbench.dataset.base import Problem
    from rlbench.reward.math import Grade
    from rlbench.rollout.engines.base import Completion
    from rlbench.rollout.groups import GradedGroups
    from rlbench.training.curricula import Curriculum

    mine, theirs = Problem("arith/train/0", "1 + 1", "2"), Problem("arith/train/0", "5 + 7", "12")
    own = [Completion(0, (1,), [5, 6], [0.0, 0.0], True) for _ in range(2)]
    shared = [Completion(0, (1,), [5], [0.0], True, behaviour="swarm:actor1", off_policy=[1]) for _ in range(2)]
    grades = [Grade(reward=float(c), correct=bool(c), format_ok=True, extracted=None) for c in (1, 0, 1, 1)]
    outcome = torch.tensor([1.0, 0.0, 1.0, 1.0])
    graded = GradedGroups([mine, theirs], [own, shared], grades, outcome, outcome, torch.ones(4, dtype=torch.bool), [0, 1])
    config = typed_config(make_cfg("experiment=smoke", "trainer.parallelism=swarm", "prompt_sampler=weighted"))
    curriculum = Curriculum(config.trainer, config.seed, [mine])
    curriculum.observe(1, graded)
    stats = curriculum.stats.get("arith/train/0")
    assert (stats.attempts, stats.correct, stats.mean_length) == (2, 1, 2.0)  # actor 1's 2 correct 1-token ones left out
    only = graded.select([0])
    assert own_groups(graded).problems == [mine] and own_groups(only) is only  # nothing shared: unchanged


def test_an_actor_has_its_own_seed_and_folder(make_cfg):
    cfg = make_cfg("experiment=smoke", "trainer.parallelism=swarm")
    zero, one = actor_config(cfg, 0), actor_config(cfg, 1)
    assert (zero.seed, Path(zero.output_dir).name) == (cfg.seed, "actor0")  # actor 0: the single run of seed
    assert (one.seed, Path(one.output_dir).name) == (rank_stream_seed(cfg.seed, 1), "actor1")
    assert one.run_name.endswith(f"-s{one.seed}")


def actor(tmp_path, index: int, store, external: int = 1, old_logprobs: str = "receiver", overrides=()):
    """Actor ``index`` of two (a step context on the tiny model) with its swarm rollout on ``store``."""
    cfg = actor_config(compose_config(["experiment=smoke", "trainer.parallelism=swarm", f"trainer.swarm.external={external}",
                                       f"trainer.swarm.old_logprobs={old_logprobs}", *overrides], tmp_path), index)
    model, tokenizer = load_policy(typed_config(cfg).model, device=torch.device("cpu"), dtype=torch.float32, seed=cfg.seed,
                                   cache_dir=cfg.cache_dir)
    ctx = make_step_context(typed_config(cfg), algorithm_from(cfg.algorithm), model, tokenizer,
                            make_engine(typed_config(cfg).rollout, model, tokenizer, torch.device("cpu")), torch.device("cpu"),
                            training_grader(typed_config(cfg)))
    ctx.policy_version = 3 + index  # versions told apart: the receiver's is not the sender's
    return ctx, swarm_rollout(ctx, typed_config(cfg), SwarmPool(store, index, 2))


def exchange(actors, problems):
    """One step of both actors, each in its own thread (the pool blocks until the other published)."""
    return together(*[lambda i=i: actors[i][1].rollout(problems[i], None) for i in range(2)])


def test_with_sender_log_probs_shared_groups_carry_their_origin_and_are_never_pi_old_samples_of_the_receiver(tmp_path):
    from rlbench.dataset.base import Problem

    store = dist.HashStore()
    actors = [actor(tmp_path / "a", 0, store, old_logprobs="sender"), actor(tmp_path / "b", 1, store, old_logprobs="sender")]
    problems = [[Problem(f"p{a}{i}", f"{a} + {i} =", str(a + i)) for i in range(2)] for a in range(2)]
    (graded, metrics), _ = exchange(actors, problems)
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


def test_by_default_the_receivers_pi_old_of_a_shared_response_is_its_own_forward_pass(tmp_path):
    """The paper's rule (arXiv:2509.08721, section 3; trainer.swarm.old_logprobs=receiver): shared tokens are
    on-policy for the receiver, so pi_old is the receiver's forward pass on them, not the sender's log-probs
    (the two actors' tiny models differ: their seeds do)."""
    from rlbench.dataset.base import Problem
    from rlbench.training.forward import batch_outputs

    store = dist.HashStore()
    actors = [actor(tmp_path / "a", 0, store), actor(tmp_path / "b", 1, store)]
    problems = [[Problem(f"p{a}{i}", f"{a} + {i} =", str(a + i)) for i in range(2)] for a in range(2)]
    (graded, _), _ = exchange(actors, problems)
    own, shared = graded.groups
    sent = pickle.loads(store.get("step1/actor1"))[0]["responses"]
    for c, r in zip(shared, sent, strict=True):
        assert c.behaviour == "swarm:actor1" and c.policy_version == 4 and c.response_ids == r["ids"]
        assert c.off_policy == [0] * len(r["ids"]) and c.behaviour_logprobs is None
    receiver = actors[0][0]
    batch = collate(graded.groups, receiver.tokenizer.pad_token_id, current_version=receiver.policy_version)
    assert batch.off_policy is None and not batch.has_off_policy  # every token's pi_old is recomputed
    own_forward = batch_outputs(receiver.model, batch, receiver.micro_batch_size, receiver.temperature).logp
    old = behaviour_old_logp(batch, own_forward)
    rows = slice(len(own), len(own) + len(shared))
    mask = batch.response_mask[rows] > 0
    assert torch.equal(old[rows], own_forward[rows])
    sender = torch.nn.utils.rnn.pad_sequence([torch.tensor(r["logprobs"]) for r in sent], batch_first=True)
    assert not torch.allclose(old[rows][mask], sender[:, :old.shape[1]][mask].to(old.dtype), atol=1e-3)


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
    run(compose_config([*SMOKE, "trainer.parallelism=swarm"], tmp_path / "swarm"))  # actor 1 of 2, J = 0
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    run(compose_config([*SMOKE, f"seed={rank_stream_seed(0, 1)}"], tmp_path / "single"))
    assert actor_metrics(tmp_path / "swarm" / "actor1") == actor_metrics(tmp_path / "single")
    swarm = json.loads((tmp_path / "swarm" / "actor1" / "summary.json").read_text())
    single = json.loads((tmp_path / "single" / "summary.json").read_text())
    assert swarm["pass_at_1_after"] == single["pass_at_1_after"]


# lag 1 (trainer.swarm.lag): step s trains on what the other actor published at step s - 1, and a stop signal
# after step s stops both after step s + 1 (lag 0, the default, is the pool's and the stop round's unit tests above)
SWARM = [*SMOKE, "trainer.steps=3", "trainer.checkpoint_every=3", "eval.before_training=true", "eval.n=1", "eval.k=[1]",
         "eval.limit=1", "trainer.parallelism=swarm", "trainer.swarm.external=1", "trainer.swarm.lag=1",
         # each actor draws prompts by its own groups' statistics and enters a stage at step 3 (group size 4)
         "prompt_sampler=weighted", "trainer.stages=[{at:3,rollout.n:4}]"]


@pytest.fixture(scope="module")
def swarm_run(tmp_path_factory):
    """The folder of an uninterrupted 2-actor swarm run of SWARM from the command line (made once)."""
    from test_resume import run_cli

    out = tmp_path_factory.mktemp("swarm") / "uninterrupted"
    proc = run_cli(SWARM, out, processes=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.slow
def test_torchrun_two_actors_share_rollouts_from_the_command_line(swarm_run):
    """torchrun -m rlbench.cli with 2 actors, I = J = 1, lag 1: each actor writes its run folder; at step 1 it
    samples both prompts itself (nothing was published a step before), then trains on one own group and one
    the other actor published a step before (its pi_old recomputed by the receiver: no token off-policy)."""
    assert json.loads((swarm_run / "status.json").read_text())["status"] == "finished"
    for me, other in ((0, 1), (1, 0)):
        rows = actor_metrics(swarm_run / f"actor{me}")
        assert not any(key.startswith("responses_swarm") for key in rows[0])  # step 1: its own groups alone
        assert [(row[f"responses_swarm:actor{other}"], row["responses_policy"]) for row in rows[1:]] == [(2, 2), (2, 4)]
        # (step 3 enters the stage of group size 4; the group shared with it was sampled at step 2, with 2)
        assert [row["max_staleness"] for row in rows[1:]] == [1, 1]  # the sender's version of a step before
        for row in rows[1:]:
            assert row["off_policy_token_fraction"] == 0.0  # shared tokens are the receiver's own (old_logprobs=receiver)
        summary = json.loads((swarm_run / f"actor{me}" / "summary.json").read_text())
        assert summary["seed"] == rank_stream_seed(0, me)
        assert [p.name for p in checkpoint.checkpoint_dirs(swarm_run / f"actor{me}")] == ["step_000003"]


@pytest.mark.slow
def test_torchrun_swarm_stopped_by_a_signal_on_one_actor_and_resumed_gives_the_uninterrupted_run(swarm_run, tmp_path):
    """2 actors sharing J = 1 group per step with lag 1: a SIGINT that reached actor 1 alone in step 1 stops
    both after step 2 (they agree through the pool on the signals of the step before), both checkpoint
    step 2 with the list they published at step 2; resumed, each puts it into the new pool, and every
    actor's metrics (timings aside) and evaluation files equal the uninterrupted swarm's."""
    from test_resume import assert_same_results, run_cli

    run_dir = tmp_path / "run"
    stopped = run_cli(SWARM, run_dir, kill_at="generate:1:INT:1", processes=2)
    assert stopped.returncode != 0
    assert f"resume with: rlbench resume={run_dir}" in stopped.stderr
    for a in range(2):
        summary = json.loads((run_dir / f"actor{a}" / "summary.json").read_text())
        assert (summary["status"], summary["signal"], summary["steps_completed"]) == ("interrupted", "SIGINT", 2)
        assert summary["checkpoint"].endswith("step_000002") and len(actor_metrics(run_dir / f"actor{a}")) == 2
    resumed = run_cli([f"resume={run_dir}"], run_dir, processes=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for a in range(2):
        summary = json.loads((run_dir / f"actor{a}" / "summary.json").read_text())
        assert (summary["status"], summary["resumed_from_step"]) == ("finished", 2)
        assert_same_results(swarm_run / f"actor{a}", run_dir / f"actor{a}")


def test_a_receiver_with_another_tokenizer_trains_on_its_own_tokens_of_the_senders_text(tmp_path):
    """trainer.swarm.models=[null, {tiny: {vocab_size: 320}}]: actor 1's tokenizer is cut to 320 ids (another
    fingerprint). Each receiver trains on its own tokenisation of the sender's decoded text (EOS where the
    sender ended), on-policy (pi_old = its forward pass), its sampling log-probs unknown (NaN), and counts
    every response whose sent ids differ from its tokens."""
    from rlbench.dataset.base import Problem
    from rlbench.training.swarm import retokenised

    store = dist.HashStore()
    mixed = ["trainer.swarm.models=[null,{tiny:{vocab_size:320}}]"]
    actors = [actor(tmp_path / "a", 0, store, overrides=mixed), actor(tmp_path / "b", 1, store, overrides=mixed)]
    assert len(actors[0][0].tokenizer) != len(actors[1][0].tokenizer) == 320
    problems = [[Problem(f"p{a}{i}", f"{a} + {i} =", str(a + i)) for i in range(2)] for a in range(2)]
    results = exchange(actors, problems)
    for me, other in ((0, 1), (1, 0)):
        (graded, metrics), tokenizer = results[me], actors[me][0].tokenizer
        sent = pickle.loads(store.get(f"step1/actor{other}"))[0]["responses"]
        shared = graded.groups[1]
        expected = [tokenizer(r["text"], add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if r["finished"] else [])
                    for r in sent]
        assert [c.response_ids for c in shared] == expected  # the sender's EOS (id 2 in both) ended each finished one
        assert [c.response_ids for c in shared] == [retokenised(tokenizer, r, 2) for r in sent]
        assert all(c.behaviour == f"swarm:actor{other}" and c.off_policy == [0] * len(c.response_ids) for c in shared)
        assert all(len(c.logprobs) == len(c.response_ids) and all(lp != lp for lp in c.logprobs) for c in shared)
        differ = sum(c.response_ids != r["ids"] for c, r in zip(shared, sent, strict=True))
        assert differ > 0 and metrics["swarm_retokenise_mismatch"] == differ
        assert max(i for c in shared for i in c.response_ids) < len(tokenizer)
    receiver = actors[1][0]  # the batch trains: pi_old is the receiver's forward pass (no NaN reaches it)
    batch = collate(results[1][0].groups, receiver.tokenizer.pad_token_id, current_version=receiver.policy_version)
    assert batch.off_policy is None and not batch.has_off_policy


def lagged_steps(tmp_path, store, steps: int, lag: int, states=None):
    """Both actors (J = 1 of 2 prompts, trainer.swarm.lag=lag) through ``steps`` steps in threads, each step's
    policy version 10 * actor + step; from ``states`` (their step contexts' state_dicts) when given. Per actor
    and step: (problem uid, response ids, policy version, behaviour) per group, and the states at the end."""
    from rlbench.dataset.base import Problem

    store.set_timeout(timedelta(seconds=120))  # a lagged read of a list never published fails instead of waiting
    actors = [actor(tmp_path / f"actor{a}", a, store, overrides=[f"trainer.swarm.lag={lag}"]) for a in range(2)]
    if states is not None:
        for (ctx, rollout), state in zip(actors, states):
            ctx.load_state_dict(state)
            ctx.strategy = rollout  # the swarm rollout's own state is in the context's
            rollout.load_state_dict(state["strategy"])
    start = actors[0][1].step

    def run(a):
        ctx, rollout = actors[a]
        rows = []
        for step in range(start + 1, start + steps + 1):
            ctx.policy_version = 10 * a + step
            problems = [Problem(f"p{a}-{step}-{i}", f"{a} + {step} + {i} =", str(a + step + i)) for i in range(2)]
            graded, _ = rollout.rollout(problems, None)
            rows.append([(p.uid, [(c.response_ids, c.policy_version, c.behaviour) for c in group])
                         for p, group in zip(graded.problems, graded.groups)])
        ctx.strategy = rollout
        return rows, ctx.state_dict()

    return together(*[lambda a=a: run(a) for a in range(2)])


def test_with_lag_d_the_shared_groups_of_step_s_are_those_published_at_step_s_minus_d(tmp_path):
    """trainer.swarm.lag = 1 (the paper's asynchrony, bounded): at step 1 nothing was published a step before,
    so each actor samples both prompts itself; at step s > 1 its shared group is one the other actor sampled
    and published at step s - 1, with that step's policy version (never the other's current step)."""
    (rows0, _), (rows1, _) = lagged_steps(tmp_path, dist.HashStore(), 3, lag=1)
    for me, other, (mine, theirs) in ((0, 1, (rows0, rows1)), (1, 0, (rows1, rows0))):
        assert [uid for uid, _ in mine[0]] == [f"p{me}-1-0", f"p{me}-1-1"]  # step 1: all own
        assert all(b == "policy" for _, group in mine[0] for _, _, b in group)
        for s in (2, 3):
            (own_uid, _), (uid, group) = mine[s - 1]
            assert own_uid == f"p{me}-{s}-0" and uid.startswith(f"p{other}-{s - 1}-")  # published at step s - 1
            published = dict(theirs[s - 2])[uid]  # the sender's own group of step s - 1
            assert [(ids, v) for ids, v, _ in group] == [(ids, v) for ids, v, _ in published]
            assert {v for _, v, _ in group} == {10 * other + s - 1} and {b for _, _, b in group} == {f"swarm:actor{other}"}


def test_a_lagged_swarm_resumed_from_its_checkpointed_state_equals_the_uninterrupted_one(tmp_path):
    """With lag 1 a step reads the others' previous step: a checkpoint carries each actor's last published
    list, which the resumed actor puts into the new store, so steps 2-3 after resuming at step 1 equal the
    uninterrupted run's (in-process: the contexts' and the swarm rollouts' state_dicts, a fresh store)."""
    whole = lagged_steps(tmp_path / "whole", dist.HashStore(), 3, lag=1)
    first = lagged_steps(tmp_path / "first", dist.HashStore(), 1, lag=1)
    assert all(state["strategy"]["published"][0][0] == 1 for _, state in first)
    for a, (_, state) in enumerate(first):  # through a checkpoint's file: plain fields only (weights_only=True)
        torch.save(state, tmp_path / f"state{a}.pt")
    states = [torch.load(tmp_path / f"state{a}.pt", weights_only=True) for a in range(2)]
    rest = lagged_steps(tmp_path / "rest", dist.HashStore(), 2, lag=1, states=states)
    for a in range(2):
        assert first[a][0] + rest[a][0] == whole[a][0]


def test_the_pool_filter_draws_only_from_groups_whose_rewards_differ(tmp_path):
    """trainer.swarm.pool_filter=zero_advantage (arXiv:2509.08721, sections 3.2 and 5): the receiver grades every
    group the other actor published, drops those whose rewards are all equal (advantage 0) and draws J from the
    rest. Actor 1 publishes 2 groups (I = 3 - 1); actor 0's grading is made to score only the second one mixed,
    actor 1's to score every group alike: none is left, and actor 1 trains on its own 2 groups alone."""
    from rlbench.dataset.base import Problem

    store = dist.HashStore()
    settings = ["trainer.prompts_per_step=3", "trainer.swarm.pool_filter=zero_advantage"]
    actors = [actor(tmp_path / f"actor{a}", a, store, overrides=settings) for a in range(2)]

    def scored(rollout, rewards):
        receive = rollout.receive

        def graded_with(chosen):
            graded, mismatches = receive(chosen)
            graded.rewards = torch.tensor(rewards)
            return graded, mismatches

        rollout.receive = graded_with

    scored(actors[0][1], [0.0, 0.0, 1.0, 0.0])  # group 0 all equal, group 1 mixed
    scored(actors[1][1], [1.0, 1.0, 0.0, 0.0])  # both all equal
    problems = [[Problem(f"p{a}{i}", f"{a} + {i} =", str(a + i)) for i in range(3)] for a in range(2)]
    (graded, metrics), (alone, others) = exchange(actors, problems)
    assert [p.uid for p in graded.problems] == ["p00", "p01", "p11"]  # the informative one of p10, p11
    assert graded.rewards[-2:].tolist() == [1.0, 0.0] and graded.group_ids == [0, 1, 2]
    assert (metrics["swarm_pool_informative_groups"], metrics["swarm_external_groups"]) == (1.0, 1.0)
    assert (others["swarm_pool_informative_groups"], others["swarm_external_groups"]) == (0.0, 0.0)
    assert [p.uid for p in alone.problems] == ["p10", "p11"] and all(c.behaviour == "policy" for g in alone.groups for c in g)
