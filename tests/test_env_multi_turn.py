"""rollout=multi_turn (rlbench/rollout/strategies/multi_turn.py) with scripted engines and environments:
turns, observation masks, per-turn step inputs, the end reasons of broken environments and caps, the
loss's independence from observation tokens, and the configuration checks."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import CharTokenizer, algorithm_from, compose_config
from test_rollout import _recompute, tiny  # noqa: F401  (tiny: the fixture of the tiny model)

from rlbench.config.schema import EnvConfig
from rlbench.config.typed import typed_config
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.rollout import GroupSampler, RolloutSetup
from rlbench.rollout.engines.base import Completion, SamplingParams
from rlbench.rollout.env import Environment, Reset, StepResult, validate_env
from rlbench.rollout.env.base import state_id
from rlbench.rollout.strategies.multi_turn import MultiTurnRollout
from rlbench.training.batch import collate

EOS = 0


class Tokens(CharTokenizer):
    """One character, one token; EOS is id 0 (dropped by decode)."""

    def encode(self, text, add_special_tokens=False):
        return [ord(ch) for ch in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i != EOS)


class ScriptedEngine:
    """Call k answers its requests (the running episodes, in order) with ``script[k]``: each entry the
    new text of that episode's turn (a trailing "$" is EOS). Log-prob -0.5 per new token."""

    def __init__(self, script):
        self.script, self.calls = list(script), []

    def generate(self, requests, params, generator=None):
        answers = self.script.pop(0)
        assert len(answers) == len(requests)
        self.calls.append([(r.prompt_ids, r.prefix_ids, r.score_prefix) for r in requests])
        out = []
        for i, (r, text) in enumerate(zip(requests, answers)):
            eos = text.endswith("$")
            new = [ord(ch) for ch in text.rstrip("$")] + ([EOS] if eos else [])
            new = new[: params.max_new_tokens]
            logprobs = [float("nan")] * len(r.prefix_ids) + [-0.5] * len(new)
            out.append([Completion(i, r.prompt_ids, list(r.prefix_ids) + new, logprobs, eos and len(new) <= params.max_new_tokens)])
        return out


class Scripted(Environment):
    """Turns end at a newline. The turn's text decides: "raise" raises, "hang" blocks until released,
    "long" answers a long observation, "win" ends with reward 1; anything else answers "ok" and
    moves to the state named by the text."""

    stop_markers = ("\n",)
    release = threading.Event()

    def reset(self, problem):
        return Reset(f"play {problem.prompt}", "start")

    def step(self, action_text):
        word = action_text.strip()
        if word == "raise":
            raise RuntimeError("broken environment")
        if word == "hang":
            self.release.wait(300)
            return StepResult("late\n", 0.0, False, "late")
        if word == "long":
            return StepResult("x" * 50, 0.0, False, "long")
        if word == "win":
            return StepResult("", 1.0, True, "goal", ended_by="goal")
        return StepResult("ok\n", 0.0, False, word)


class Factory:
    """What RolloutSetup.env holds: the env node (caps) and one environment per call."""

    def __init__(self, env_class=Scripted, **caps):
        self.config = EnvConfig(name="scripted", **{"max_turns": 4, "turn_tokens": 8, "max_tokens": 64,
                                                    "max_observation_tokens": 10, "step_timeout_s": 5.0, **caps})
        self.env_class = env_class

    def __call__(self):
        return self.env_class(None, None)


def run(script, n, factory=None, shape=lambda rewards, inputs: rewards, problems=("x",)):
    sampler = GroupSampler(ScriptedEngine(script), None, Tokens(), {"user": "{problem}"}, shape)
    setup = RolloutSetup(sampler, n, SamplingParams(1.0, 1.0, 16), None, env=factory or Factory())
    strategy = MultiTurnRollout(setup)
    groups, metrics = strategy.rollout([p if isinstance(p, Problem) else Problem(str(i), p, "0") for i, p in enumerate(problems)])
    return groups, metrics, sampler.engine


def test_turns_observations_and_step_inputs():
    groups, metrics, engine = run([["go\nIGNORED", "stay$"], ["win\n"]], n=2)
    won, stopped = groups.groups[0]
    # the turn is cut just after its newline; the observation follows with loss mask 0
    assert won.text == "go\nok\nwin\n"
    assert won.loss_mask == [1, 1, 1, 0, 0, 0, 1, 1, 1, 1]
    assert won.extras["step_index"] == [0, 0, 0, -1, -1, -1, 1, 1, 1, 1]
    start, go = state_id("start"), state_id("go")
    assert won.extras["turn_states"] == [start] * 3 + [-1] * 3 + [go] * 4
    assert won.extras["turn_rewards"] == [0.0] * 6 + [1.0] * 4
    assert won.logprobs == [-0.5] * 3 + [0.0] * 3 + [-0.5] * 4 and won.finished
    # EOS without a turn end: the environment sees the turn, the episode ends (model_stopped), EOS kept
    assert stopped.response_ids == [ord(c) for c in "stay"] + [EOS] and stopped.loss_mask == [1] * 5
    assert groups.outcome.tolist() == [1.0, 0.0] and groups.rewards.tolist() == [1.0, 0.0]
    assert [g.correct for g in groups.grades] == [True, False]
    # the prompt is the environment's first observation; later turns continue the response unscored
    assert engine.calls[0][0] == (tuple(ord(c) for c in "play x"), (), False)
    assert engine.calls[1] == [(tuple(ord(c) for c in "play x"), tuple(ord(c) for c in "go\nok\n"), False)]
    assert metrics["multi_turn_turns"] == 1.5 and metrics["multi_turn_observation_share"] == pytest.approx(3 / 15)
    assert metrics["multi_turn_ended_goal"] == 1 and metrics["multi_turn_ended_model_stopped"] == 1


@pytest.mark.parametrize("workers", [1, 4])  # one at a time: the hung step frees its slot at its time-out
def test_broken_environments_end_their_episode_and_the_step_goes_on(workers):
    Scripted.release.clear()
    factory = Factory(step_timeout_s=1.0, workers=workers)
    try:
        groups, metrics, _ = run([["raise\n", "hang\n", "long\n", "a\n"], ["win\n"]], n=4, factory=factory)
    finally:
        Scripted.release.set()
    ended = {k: v for k, v in metrics.items() if k.startswith("multi_turn_ended_")}
    assert ended == {"multi_turn_ended_env_error": 1, "multi_turn_ended_env_timeout": 1,
                     "multi_turn_ended_observation_too_long": 1, "multi_turn_ended_goal": 1}
    raised, hung, long, fine = groups.groups[0]
    assert long.text == "long\n" and long.loss_mask == [1] * 5  # the over-long observation is not inserted
    assert [c.finished for c in (raised, hung, long, fine)] == [False, False, False, True]
    assert groups.outcome.tolist() == [0.0, 0.0, 0.0, 1.0]


def test_caps_end_episodes():
    groups, metrics, _ = run([["a\n"], ["b\n"]], n=1, factory=Factory(max_turns=2))
    assert metrics["multi_turn_ended_turn_cap"] == 1 and groups.groups[0][0].text == "a\nok\nb\n"
    # 64-token budget: "a\n" + "ok\n" fits, the next turn is cut at the budget
    groups, metrics, _ = run([["a\n"], ["bcdefgh"]], n=1, factory=Factory(max_tokens=8, turn_tokens=7))
    assert metrics["multi_turn_ended_token_budget"] == 1 and len(groups.groups[0][0].response_ids) == 8


def test_length_shaping_counts_policy_tokens_only():
    seen = {}

    def shape(rewards, inputs):
        seen.update(inputs)
        return rewards

    run([["go\n"], ["win\n"]], n=1, shape=shape)
    assert seen["response_lengths"].tolist() == [7]  # 10 response tokens, 3 of them observation


def test_observation_tokens_do_not_change_the_loss():
    """Token-level pieces (policy loss, KL, entropy bonus, aggregation denominators) see a batch whose
    observation tokens are masked exactly as the batch with those tokens removed."""
    groups, _, _ = run([["go\n", "a\n"], ["win\n", "b\n"], ["c$"]], n=2)
    batch = collate(groups.groups, pad_token_id=EOS)
    mask = batch.response_mask
    assert mask.sum().item() == sum(sum(c.loss_mask) for c in groups.groups[0])
    torch.manual_seed(0)
    shape = mask.shape
    logp, old, ref, entropy = -torch.rand(shape), -torch.rand(shape), -torch.rand(shape), torch.rand(shape)
    advantages = torch.randn(shape) * mask
    kept = [row.nonzero(as_tuple=True)[0] for row in mask > 0]
    width = max(len(k) for k in kept)

    def packed(values):
        out = torch.zeros(len(kept), width)
        for row, positions in enumerate(kept):
            out[row, : len(positions)] = values[row, positions]
        return out

    short_mask = packed(mask)
    for aggregation in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
        algorithm = algorithm_from({"name": "t", "advantage": {"name": "grpo"}, "aggregation": {"name": aggregation},
                                    "loss": {"name": "ppo_clip", "clip_low": 0.2, "clip_high": 0.2},
                                    "kl": {"coef": 0.1, "estimator": "k3"}, "entropy_coef": 0.01})

        def loss(m, *tensors, algorithm=algorithm):
            lp, o, r, e, a = tensors
            norms = {"batch_tokens": int(m.sum()), "batch_sequences": m.shape[0], "norm_length": 16}
            return algorithm.compute_loss(logp=lp, old_logp=o, ref_logp=r, entropy=e, advantages=a, response_mask=m, norms=norms)[0]

        full = loss(mask, logp, old, ref, entropy, advantages)
        removed = loss(short_mask, *(packed(t) for t in (logp, old, ref, entropy, advantages)))
        assert full.item() == pytest.approx(removed.item(), rel=1e-6), aggregation
        noisy = [t + 5.0 * (mask == 0) for t in (logp, old, ref, entropy)]  # anything on observation tokens
        assert loss(mask, *noisy, advantages).item() == pytest.approx(full.item(), rel=1e-6), aggregation


def test_configuration_is_checked_before_the_model_loads(tmp_path):
    cfg = typed_config(compose_config(["rollout=multi_turn", "env=gridworld"], tmp_path))
    assert cfg.env.name == "gridworld" and cfg.env.settings["gridworld"]["size"] == 3
    validate_env(cfg.env, cfg.rollout.strategy)
    with pytest.raises(ConfigError, match="needs an environment"):
        validate_env(None, "multi_turn")
    with pytest.raises(ConfigError, match="only used by rollout=multi_turn"):
        validate_env(cfg.env, "iid")
    validate_env(cfg.env, "multi_turn", "eval")  # evaluation runs episodes (tests/test_eval_env.py)
    validate_env(cfg.env, "iid", "eval")  # mode=eval trains nothing: the strategy does not matter
    with pytest.raises(ConfigError, match="mode=generate writes single-turn traces"):
        validate_env(cfg.env, "multi_turn", "generate")
    with pytest.raises(ConfigError, match="no key"):
        validate_env(EnvConfig(name="gridworld", settings={"gridworld": {"sise": 4}}), "multi_turn")
    with pytest.raises(ConfigError, match="unknown"):
        validate_env(EnvConfig(name="nowhere"), "multi_turn")
    with pytest.raises(ConfigError, match="size must be >= 2"):
        validate_env(EnvConfig(name="gridworld", settings={"gridworld": {"size": 1}}), "multi_turn")


@pytest.mark.slow
def test_tiny_model_episodes_reuse_the_kv_and_record_the_policys_log_probs(tiny):  # noqa: F811 (the fixture)
    """The real engine: with the KV kept across turns (prefix_cache_mb) the episodes are the ones sampled
    without it, later turns hit the cache, and the log-prob recorded for each policy token is the policy's
    own, recomputed by one forward over the whole episode (observations included in the context)."""
    from rlbench.rollout import HFGenerateEngine
    from rlbench.rollout.env import EnvContext, EnvFactory

    model, tokenizer = tiny
    config = EnvConfig(name="gridworld", max_turns=3, turn_tokens=3, max_tokens=96, max_observation_tokens=32,
                       settings={"gridworld": {"moves": "initials"}})
    problems = [Problem("a", "", "0"), Problem("b", "", "0")]

    def episodes(cache_mb):
        engine = HFGenerateEngine(model, tokenizer, progress=False, prefix_cache_mb=cache_mb)
        sampler = GroupSampler(engine, None, tokenizer, {"user": "{problem}"}, lambda r, _: r)
        setup = RolloutSetup(sampler, 3, SamplingParams(1.0, 1.0, 16), torch.Generator().manual_seed(5),
                             env=EnvFactory(config, EnvContext()))
        groups, metrics = MultiTurnRollout(setup).rollout(problems)
        return groups, metrics, engine

    plain, _, _ = episodes(0)
    cached, metrics, engine = episodes(16)
    assert engine.prefix_cache.stats.hits > 0 and metrics["multi_turn_turns"] > 1
    for a, b in zip(plain.groups, cached.groups):
        assert [c.response_ids for c in a] == [c.response_ids for c in b]
    for c in (c for group in cached.groups for c in group):
        recomputed = _recompute(model, c.prompt_ids, c.response_ids)
        policy = torch.tensor(c.loss_mask, dtype=torch.bool)
        assert torch.allclose(torch.tensor(c.logprobs)[policy], recomputed[policy], atol=1e-4)
