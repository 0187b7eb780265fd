"""algorithm=arpo (conf/algorithm/arpo.yaml; ARPO, Dong et al. 2025, arXiv:2507.19849, section 3):
rollout=multi_turn with ``branch: entropy_tool`` on a mock tool environment and a scripted policy whose
entropy spikes after one tool observation. Checked: it branches exactly there and nowhere else, a group
holds M episodes, branches share the prefix token for token, hard attribution gives a shared token the
mean advantage of its descendant leaves (hand-computed) and trains it once, soft attribution is GRPO per
episode, tau = inf equals plain multi_turn with M episodes; AEPO's consecutive-branch penalty (arXiv:2510.14545)
decays the probability geometrically in l and, at 1, stops a path from branching at two observations in a row;
the option checks. AEPO's entropy pre-monitoring (rollout=aepo_tool): a probe episode's question and tool-step
entropies set the group's global episodes by the closed form, and the probe is not trained."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import CharTokenizer, compose_config

from rlbench.algorithm.advantages.group_relative import grpo_advantage
from rlbench.algorithm.advantages.tree import arpo_hard_advantage
from rlbench.config.schema import EnvConfig
from rlbench.config.typed import typed_config
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.rollout import GroupSampler, RolloutSetup
from rlbench.rollout.engines.base import Completion, PositionStats, SamplingParams
from rlbench.rollout.env import Environment, Reset, StepResult
from rlbench.rollout.strategies.multi_turn import MultiTurnOptions, MultiTurnRollout, branch_probability
from rlbench.training.batch import collate

EOS = 0
HOT = "hot!\n"  # the observation after which the policy's entropy spikes


class Tokens(CharTokenizer):
    """One character, one token; EOS is id 0 (dropped by decode)."""

    def encode(self, text, add_special_tokens=False):
        return [ord(ch) for ch in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i != EOS)


class Tool(Environment):
    """A mock tool: turns end at a newline; "call" answers "out", "hot" answers the spiking observation, "win" /
    "lose" end the episode (reward 1 / 0), anything else answers "ok"."""

    stop_markers = ("\n",)

    def reset(self, problem):
        return Reset(f"solve {problem.prompt}", "start")

    def step(self, action_text):
        word = action_text.strip()
        if word in ("win", "lose"):
            return StepResult("", float(word == "win"), True, word, ended_by="answer")
        return StepResult({"call": "out\n", "hot": HOT}.get(word, "ok\n"), 0.0, False, word)


class Factory:
    def __init__(self):
        self.config = EnvConfig(name="tool", max_turns=6, turn_tokens=8, max_tokens=64, max_observation_tokens=10, step_timeout_s=5.0)

    def __call__(self):
        return Tool(None, None)


class Policy:
    """A scripted policy: its turn depends on the response so far and on how many times that response was
    continued before (the c-th continuation of a prefix): turn 1 "call"; after "out" "hot" (c even) or "cool"
    (c odd); after the spike "win" (c even) or "lose" (c odd); after "ok" "lose". Its entropy (``position_stats``,
    log |V| = 1) is 0.9 on the tokens of the turn that follows the spiking observation, 0.1 elsewhere."""

    def __init__(self):
        self.seen: dict[tuple[int, ...], int] = {}
        self.scored: list[str] = []

    def generate(self, requests, params, generator=None):
        out = []
        for i, r in enumerate(requests):
            so_far = "".join(chr(t) for t in r.prefix_ids)
            c = self.seen.get(r.prefix_ids, 0)
            self.seen[r.prefix_ids] = c + 1
            if not so_far:
                text = "call\n"
            elif so_far.endswith("out\n"):
                text = "cool\n" if c % 2 else "hot\n"
            elif so_far.endswith(HOT):
                text = "lose\n" if c % 2 else "win\n"
            else:
                text = "lose\n"
            new = [ord(ch) for ch in text][: params.max_new_tokens]
            out.append([Completion(i, r.prompt_ids, list(r.prefix_ids) + new, [0.0] * len(r.prefix_ids) + [-0.5] * len(new), False)])
        return out

    def position_stats(self, items, params):
        stats = []
        for _, response in items:
            text = "".join(chr(t) for t in response)
            entropy = []
            for t in range(len(text)):
                head, hot, tail = text[:t].rpartition(HOT)
                entropy.append(0.9 if hot and "\n" not in tail else 0.1)
            e = torch.tensor(entropy, dtype=torch.float64)
            self.scored.append(text)
            stats.append(PositionStats(torch.zeros(len(e), 2, dtype=torch.long), torch.zeros(len(e), 2), e, math.e))
        return stats


def run(n, problems=("x",), policy=Policy, **options):
    """One rollout of the scripted policy: ``n`` = M, ``options`` the rollout.multi_turn block."""
    sampler = GroupSampler(policy(), None, Tokens(), {"user": "{problem}"}, lambda rewards, inputs: rewards)
    setup = RolloutSetup(sampler, n, SamplingParams(1.0, 1.0, 16), torch.Generator().manual_seed(0), env=Factory())
    strategy = MultiTurnRollout(setup, MultiTurnOptions(**options))
    groups, metrics = strategy.rollout([Problem(str(i), p, "0") for i, p in enumerate(problems)])
    return groups, metrics, sampler.engine


# a spike of 0.8 weighed 10 makes P = u + 8 > tau = 1 (no draw needed); no rise leaves P = u < 1: never
SPIKE = dict(branch="entropy_tool", global_samples=2, branch_width=2, entropy_tokens=3, beta=10.0, threshold=1.0)
PREFIX = "call\nout\nhot\n" + HOT


def test_branches_exactly_after_the_spiking_observation_and_fills_the_group_to_m():
    groups, metrics, policy = run(5, **SPIKE)
    texts = [c.text for c in groups.groups[0]]
    # g0 (hot) branches twice at the spike; g1 (cool) decides after "ok" with no rise and does not branch; the group,
    # one short of M = 5 when every episode has ended, gets a global sample (it reaches the spike, with no room left)
    assert texts == [PREFIX + "win\n", "call\nout\ncool\nok\nlose\n", PREFIX + "lose\n", PREFIX + "win\n", PREFIX + "lose\n"]
    assert len(groups.groups[0]) == 5 and groups.outcome.tolist() == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert metrics["multi_turn_branches"] == 2 and metrics["multi_turn_branch_filled"] == 1
    # decisions: each global episode after "out" (rise 0), g0 after the spike (rise 0.8), g1 after "ok" (rise 0)
    assert metrics["multi_turn_branch_decisions"] == 4
    assert metrics["multi_turn_branch_entropy_rise"] == pytest.approx(0.8 / 4)
    # the entropy was measured on the first k = 3 tokens of each turn after an observation, never on a first turn
    assert sorted(policy.scored) == sorted(["call\nout\nhot", "call\nout\ncoo", PREFIX + "win", "call\nout\ncool\nok\nlos"])


def test_branches_share_the_prefix_token_for_token_and_its_tree_node():
    groups, _, _ = run(5, **SPIKE)
    trunk, _, first, second, _ = groups.groups[0]
    k = len(PREFIX)
    assert first.response_ids[:k] == second.response_ids[:k] == trunk.response_ids[:k] == [ord(c) for c in PREFIX]
    assert first.logprobs[:k] == trunk.logprobs[:k] and first.extras["step_index"][:k] == trunk.extras["step_index"][:k]
    nodes = [c.extras["tree_nodes"] for c in (trunk, first, second)]
    shared = {row[0] for row in nodes}
    assert len(shared) == 1 and all(set(row[:k]) == shared for row in nodes)  # one node for the prefix
    own = [set(row[k:]) for row in nodes]
    assert all(len(s) == 1 for s in own) and len(set.union(*own)) == 3 and not shared & set.union(*own)


def test_soft_attribution_trains_every_copy_and_is_grpo_per_episode():
    groups, _, _ = run(5, **SPIKE, attribution="soft")
    assert all(c.loss_mask == [0 if s < 0 else 1 for s in c.extras["step_index"]] for c in groups.groups[0])
    batch = collate(groups.groups, pad_token_id=EOS)
    grpo = grpo_advantage(groups.rewards, batch.group_index, batch.response_mask)
    rewards = torch.tensor([1.0, 0, 0, 1, 0])
    a = (rewards - 0.4) / (rewards.std() + 1e-6)
    assert torch.allclose(grpo, a[:, None] * batch.response_mask, atol=1e-6)
    # on a tree without shared tokens (every episode its own node) hard attribution is GRPO too
    flat = torch.where(batch.extras["tree_nodes"] >= 0, torch.arange(5)[:, None], -1)
    assert torch.allclose(arpo_hard_advantage(groups.rewards, batch.group_index, flat, batch.response_mask), grpo, atol=1e-6)


def test_hard_attribution_gives_shared_tokens_the_mean_advantage_of_their_leaves_once():
    groups, _, _ = run(5, **SPIKE, attribution="hard")
    trunk, cool, first, second, filled = groups.groups[0]
    k = len(PREFIX)
    policy_mask = [0 if s < 0 else 1 for s in trunk.extras["step_index"]]
    assert trunk.loss_mask == policy_mask  # the prefix is trained in the episode that sampled it ...
    assert first.loss_mask[:k] == second.loss_mask[:k] == [0] * k  # ... and is context in its branches
    assert first.loss_mask[k:] == [1] * 5
    batch = collate(groups.groups, pad_token_id=EOS)
    advantage = arpo_hard_advantage(groups.rewards, batch.group_index, batch.extras["tree_nodes"], batch.response_mask)
    # rewards [1, 0, 0, 1, 0]: mean 0.4, unbiased std sqrt(0.3); A = 0.6 / sqrt(0.3) (wins), -0.4 / sqrt(0.3) (losses)
    win, lose = 0.6 / math.sqrt(0.3), -0.4 / math.sqrt(0.3)
    shared = (win + lose + win) / 3  # the prefix's leaves: the trunk and its two branches
    assert shared == pytest.approx(0.8 / (3 * math.sqrt(0.3)))
    rows = [trunk, cool, first, second, filled]
    expected = torch.zeros_like(advantage)
    own = [win, lose, lose, win, lose]
    for row, (c, a) in enumerate(zip(rows, own)):
        for t, m in enumerate(c.loss_mask):
            if m:
                expected[row, t] = shared if (row == 0 and t < k) else a
    assert torch.allclose(advantage, expected, atol=1e-5)


def test_never_branching_equals_plain_multi_turn_with_m_episodes():
    branched, metrics, _ = run(4, **{**SPIKE, "threshold": math.inf})
    plain, _, _ = run(4)
    assert metrics["multi_turn_branches"] == 0 and metrics["multi_turn_branch_filled"] == 2
    for a, b in zip(branched.groups[0], plain.groups[0], strict=True):
        assert (a.response_ids, a.logprobs, a.loss_mask) == (b.response_ids, b.logprobs, b.loss_mask)
        assert {key: a.extras[key] for key in b.extras} == b.extras
    assert torch.equal(branched.rewards, plain.rewards)


def test_the_branch_probability_draws_from_the_run_generator_only_when_it_decides():
    generator = torch.Generator().manual_seed(3)
    u = float(torch.rand((), generator=torch.Generator().manual_seed(3), dtype=torch.float64))
    assert branch_probability(0.1, None, 2.0, 0.5, generator) == pytest.approx(u + 0.2)
    before = generator.get_state()
    assert branch_probability(0.5, None, 2.0, 0.5, generator) == 1.0  # beta dH = 1 > tau: branches whatever u
    assert branch_probability(0.1, None, 2.0, math.inf, generator) == pytest.approx(0.2)  # never
    assert torch.equal(generator.get_state(), before)
    assert branch_probability(0.1, 0.3, 2.0, 0.5, generator) == pytest.approx(0.5)  # a fixed alpha


class HotPolicy(Policy):
    """Calls the tool, then says "hot" every turn: the entropy spikes after every observation but the first."""

    def generate(self, requests, params, generator=None):
        out = []
        for i, r in enumerate(requests):
            new = [ord(ch) for ch in ("hot\n" if r.prefix_ids else "call\n")]
            out.append([Completion(i, r.prompt_ids, list(r.prefix_ids) + new, [0.0] * len(r.prefix_ids) + [-0.5] * len(new), False)])
        return out


def branch_turns(completion):
    """The turns at whose start the episode's path changes tree node: its branch points."""
    nodes, turns = completion.extras["tree_nodes"], completion.extras["step_index"]
    return [turns[t] for t in range(1, len(nodes)) if nodes[t] != nodes[t - 1]]


def test_the_consecutive_branch_penalty_decays_geometrically_and_stops_branching_twice_in_a_row():
    values = [branch_probability(0.1, 0.3, 2.0, 0.5, None, consecutive=streak, penalty=0.25) for streak in range(5)]
    assert values[0] == pytest.approx(0.5)
    assert all(b / a == pytest.approx(0.75) for a, b in zip(values, values[1:]))  # (1 - P)^l
    # with u drawn: P = (u + beta dH) (1 - P)^l, the same draw as without the penalty
    drawn = [branch_probability(0.1, None, 2.0, 0.05, torch.Generator().manual_seed(5), streak, 0.25) for streak in range(3)]
    assert all(b / a == pytest.approx(0.75) for a, b in zip(drawn, drawn[1:]))
    # every observation after the first spikes (turns 2..5 of 6); M = 4 from one global episode, Z = 1
    spiky = {**SPIKE, "global_samples": 1, "branch_width": 1}
    free, _, _ = run(4, policy=HotPolicy, **spiky)
    assert branch_turns(free.groups[0][0]) == [2, 3, 4]  # no penalty: the trunk branches at every spike
    penalised, metrics, _ = run(4, policy=HotPolicy, **spiky, branch_penalty=1.0)
    trunk, *branches = penalised.groups[0]
    assert branch_turns(trunk) == [2, 4] and metrics["multi_turn_branches"] == 3
    assert all(b - a > 1 for c in penalised.groups[0] for a, b in zip(branch_turns(c), branch_turns(c)[1:]))


def test_the_preset_composes_and_bad_settings_are_refused_before_the_model_loads(tmp_path):
    cfg = compose_config(["algorithm=arpo"], tmp_path)
    assert cfg.algorithm.name == "arpo" and cfg.rollout.strategy == "multi_turn" and cfg.env.name == "python_tool"
    assert cfg.rollout.multi_turn.branch == "entropy_tool" and cfg.algorithm.advantage.name == "grpo"
    rollout = typed_config(cfg).rollout
    MultiTurnRollout.validate(rollout, "grpo")
    assert MultiTurnOptions.from_config(rollout).globals_of(rollout.n) == rollout.n // 2
    for override, message in ((["rollout.multi_turn.global_samples=17"], "global_samples"),
                              (["rollout.multi_turn.branch_width=0"], "branch_width"),
                              (["rollout.multi_turn.attribution=both"], "attribution"),
                              (["rollout.multi_turn.branch_penalty=1.5"], "branch_penalty"),
                              (["rollout.n=1"], "rollout.n >= 2")):
        with pytest.raises(ConfigError, match=message):
            MultiTurnRollout.validate(typed_config(compose_config(["algorithm=arpo", *override], tmp_path)).rollout, "grpo")
    hard = typed_config(compose_config(["algorithm=arpo", "rollout.multi_turn.attribution=hard"], tmp_path)).rollout
    with pytest.raises(ConfigError, match="arpo_hard"):
        MultiTurnRollout.validate(hard, "grpo")
    MultiTurnRollout.validate(hard, "arpo_hard")
    plain = typed_config(compose_config(["rollout=multi_turn", "env=gridworld"], tmp_path)).rollout
    with pytest.raises(ConfigError, match="entropy_tool"):
        MultiTurnRollout.validate(plain, "arpo_hard")


def test_pre_monitoring_sets_the_global_episodes_from_a_probe_that_is_not_trained():
    # the probe is the policy's first episode: "call" (turn 0), "hot" (turn 1), "win" after the spike (turn 2); the
    # entropy of each turn's first k = 3 tokens: 0.1, 0.1, 0.9, so H_root = 0.1 and H_tool = (0.1 + 0.9) / 2 = 0.5
    monitored = {**SPIKE, "global_samples": None}
    for beta in (10.0, 2.0, -10.0):
        expected = max(1, min(5, int(5 / (1 + math.exp(-beta * (0.1 - 0.5)))) + 1))  # 1, 2 and 5
        groups, metrics, policy = run(5, **monitored, pre_monitor_beta=beta)
        assert metrics["multi_turn_branch_globals"] == expected
        assert len(groups.groups[0]) == 5
        assert policy.scored[0] == PREFIX + "win\n"  # the probe was measured first ...
        first_turns = policy.seen[()]  # ... and is not one of the group: M episodes plus the probe began
        assert first_turns == 1 + 5 - metrics["multi_turn_branches"]
        assert metrics["multi_turn_branches"] + metrics["multi_turn_branch_filled"] == 5 - expected
    assert 0.1 - 0.5 < 0 and expected == 5  # beta < 0: every episode global, no room to branch
    # N = 2: the second global episode reaches the spike and branches twice; one global sample fills the group
    _, metrics, _ = run(5, **monitored, pre_monitor_beta=2.0)
    assert (metrics["multi_turn_branches"], metrics["multi_turn_branch_filled"]) == (2, 1)


def test_the_aepo_tool_preset_and_its_refusals(tmp_path):
    cfg = compose_config(["paper=aepo", "experiment=smoke"], tmp_path)
    assert cfg.algorithm.name == "aepo" and cfg.env.name == "python_tool" and cfg.rollout.strategy == "multi_turn"
    block = cfg.rollout.multi_turn
    assert (block.branch, block.global_samples, block.pre_monitor_beta, block.branch_penalty) == ("entropy_tool", None, 0.5, 0.05)
    MultiTurnRollout.validate(typed_config(cfg).rollout, "grpo")
    for override, message in ((["rollout.multi_turn.global_samples=2"], "keep one"),
                              (["rollout.multi_turn.pre_monitor_beta=inf"], "pre_monitor_beta"),
                              (["rollout.multi_turn.branch=none"], "needs branch=entropy_tool")):
        with pytest.raises(ConfigError, match=message):
            MultiTurnRollout.validate(typed_config(compose_config(["rollout=aepo_tool", "env=gridworld", *override], tmp_path)).rollout, "grpo")
