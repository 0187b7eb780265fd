"""Multi-turn episodes (``rollout=multi_turn``, with ``env=<name>``; docs/agents.md): the policy acts,
the environment (rlbench/rollout/env/) answers, the policy continues.

Per prompt, ``rollout.n`` episodes, each with its own environment. Each turn the episodes still running
advance together: one engine call continues every one of them from its response so far (the prompt is
the environment's first observation as the user message, after the dataset's system message if any; the
response so far is passed as ``prefix_ids``, not scored again, so with ``rollout.prefix_cache_mb`` > 0 the hf engine reuses its
KV and prefills only the new tokens). A turn is cut just after the environment's turn end (a stop
marker, a closed tool block), else it ends at ``env.turn_tokens`` or EOS; the environment's
observation is tokenized and appended. The response of an episode is its policy tokens and its
observation tokens in order; observation tokens carry ``loss_mask`` 0, so collate leaves them out of
``response_mask`` and no piece of the loss (policy loss, KL, entropy, aggregation denominators) and no
length-based reward shaping counts them (shaping sees the policy tokens only, and ``policy_code`` the code
blocks of the policy turns without the observations).

An episode ends when the environment says done, the policy ends its turn with EOS (``model_stopped``),
or a cap is reached: ``turn_cap`` (env.max_turns), ``tool_call_cap`` (env.max_tool_calls: right after the
last allowed call, or, for an environment that ``answers_after_last_call``, at a call past it),
``token_budget`` (env.max_tokens, policy and observation tokens together), ``observation_too_long``
(an observation over env.max_observation_tokens is not inserted). An environment that raises
(``env_error``) or does not answer within env.step_timeout_s (``env_timeout``) ends its episode alone:
the step goes on, and every reason is counted in the metrics ``multi_turn_ended_<reason>``.

The episode's reward is the sum of its turns' rewards (the environment's ``grade`` gives the verdict);
the algorithm's reward shaping applies to it. Per-token step inputs for turn-level advantages (GiGPO):
``step_index`` (the turn of each policy token, -1 on observation tokens), ``turn_states`` (an integer
id of the state the turn's action was taken in) and ``turn_rewards`` (the turn's reward).

With ``rollout.multi_turn.branch: random_turn`` (REFUEL, Gao et al. 2024, arXiv:2410.04612, section 4 /
Algorithm 1; algorithm=refuel) a group is a branch at a random turn instead of n independent episodes:
per prompt, h ~ U{1..env.max_turns} (the run's sampling generator); one episode rolls in turns 1..h-1
with the sampling policy; at turn h it forks into n branches (Environment.fork), which complete their
dialogues independently. The branches share turns 1..h-1 token for token; only the turn-h tokens keep
loss mask 1 (the loss regresses their log-ratio), and a branch's reward is its future return
``Q = sum_{k >= h} r_k`` (the rewards before the branch are left out; they are equal within the group).
A roll-in that ends before turn h leaves its group with nothing trained (counted:
``multi_turn_branch_missed``); ``multi_turn_branch_turn`` is the mean h.

With ``rollout.multi_turn.branch: entropy_tool`` (ARPO, Dong et al. 2025, "Agentic Reinforced Policy
Optimization", arXiv:2507.19849, section 3, entropy-based adaptive rollout; algorithm=arpo) a group of
M = ``rollout.n`` episodes starts as N = ``global_samples`` episodes (default M // 2). After every
observation (a tool's result) the policy's next turn is generated, and the normalised entropy
(entropy / log |V|, the engine's ``position_stats``) of its first k = ``entropy_tokens`` tokens, H_t, is
compared with the episode's initial entropy H_0 (its first turn's first k tokens; a branch keeps its
root's):

    P_t = alpha + beta * (H_t - H_0)          (alpha null: u ~ U(0, 1), the run's sampling generator)

If P_t > tau (``threshold``), Z = ``branch_width`` branches fork (Environment.fork) from the point just after
the observation, while the group holds fewer than M episodes; each generates its own turn from there and
runs as an episode of its own, and may branch again at a later observation. Branches share the prefix token for token (tree node
ids in the step input ``tree_nodes``). A group still short of M when all its episodes have ended is filled
with global samples. ``attribution: soft``: every branch keeps its copy of the prefix as trained tokens (GRPO's
per-episode advantage applies to it); ``hard``: a branch carries the inherited prefix as context (loss mask
0), so a shared token is trained once, in the episode that sampled it, and ``algorithm/advantage=arpo_hard``
gives it the mean advantage of the episodes below it. A uniform draw is taken only when it can decide
(beta * dH <= tau < 1 + beta * dH), so tau = inf never draws. ``branch_penalty`` > 0 adds AEPO's
consecutive-branch penalty (Dong et al. 2025, arXiv:2510.14545, section 3): P_t * (1 - branch_penalty)^l, l the
branch points just before on the episode's path that all branched (its branches inherit l + 1).
``pre_monitor_beta`` (a number; then ``global_samples`` stays null) adds AEPO's entropy pre-monitoring
(arXiv:2510.14545, section 3; rollout=aepo_tool): per prompt a probe episode runs first, to its end and
without branching; H_root is the mean normalised entropy of its first turn's first k tokens and H_tool the mean
over its later turns (each follows a tool result) of their first k tokens' (H_root when it made no tool call),
and the group's global episodes are N = clip(floor(M * sigmoid(pre_monitor_beta * (H_root - H_tool))) + 1, 1, M)
(rlbench.rollout.strategies.entropy_branch.global_samples, the single-turn rollout's rule): a question more
uncertain than its tool steps gets more independent episodes, one whose tool results raise the uncertainty more
branches. The probe only measures: it is not one of the group's M episodes (it could not branch once run, and
taking it as a global episode would leave a group with N = 1 nothing to branch from), and its tokens count in
the step's ``generated_tokens``. Metrics: ``multi_turn_branch_decisions``,
``multi_turn_branches``, ``multi_turn_branch_filled`` (global samples added to fill a group),
``multi_turn_branch_entropy_rise`` (the mean H_t - H_0 over the decisions) and, with pre-monitoring,
``multi_turn_branch_globals`` (the mean N).

With ``rollout.multi_turn.dynamic_sampling: true`` (conf/rollout/multi_turn_filtered.yaml; algorithm=dapo_multi_turn)
a step keeps only the groups whose episodes differ, DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476,
section 3.2) over whole episodes: rounds of episodes on more prompts until the batch is full, filtered by
rlbench.rollout.strategies.dynamic_sampling's own code, with ``rollout.multi_turn.max_rounds`` and ``.metric`` as
that strategy's block has them; the episode metrics count every round's episodes.

With ``rollout.multi_turn.branch: greedy_tree`` (AT-GRPO, Zhao et al. 2025, "Stronger Together: On-Policy RL
for Collaborative LLMs", arXiv:2510.11062, section 3, tree-structured sampling; algorithm=at_grpo) a prompt's
episode is a greedy tree: at every turn the environment is forked (Environment.fork) into K = ``rollout.n``
copies, each samples one candidate action, and the candidates' turn rewards are compared; the best candidate
(the highest turn reward, ties to the first in sampling order) advances: every candidate of the next turn
continues from it (its tokens, its environment), so a turn's candidates share one state. Each candidate is a
completion of its own: the shared history (loss mask 0: trained at its own turn) and its turn (loss mask 1);
its reward is its turn's reward. The K candidates of a turn form a group (one per prompt and turn: AT-GRPO's
key, with the turn fixing the role), so GRPO's normalisation within the group is the key's. The tree stops
when its best candidate ends the episode (done, EOS, a cap): K x (turns taken) <= K x ``env.max_turns``
completions per prompt. Metrics: ``multi_turn_tree_turns`` (mean turns of a tree) and
``multi_turn_tree_ties`` (turns whose best reward was shared by several candidates).

Metrics: turns, tool calls, tool errors and seconds per episode, the share of observation tokens in the
responses, and the end reasons.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import math
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rlbench.algorithm.registry import ADVANTAGES
from rlbench.config.schema import RolloutConfig
from rlbench.dataset.base import Problem
from rlbench.dataset.prompts import build_messages
from rlbench.errors import ConfigError
from rlbench.model.lora import role_adapters, turn_adapter
from rlbench.prompting import encode_prompts
from rlbench.reward.math import Grade
from rlbench.rollout.engines.base import Completion, GenerationRequest, SamplingParams
from rlbench.rollout.env.base import (
    Environment,
    EnvTimeout,
    StepResult,
    call_all_with_timeout,
    state_id,
)
from rlbench.rollout.groups import GradedGroups, policy_code, shaping_inputs
from rlbench.rollout.strategies.dynamic_sampling import (
    DynamicSamplingOptions,
    refuse_tracker_baseline,
    sample_informative_groups,
)
from rlbench.rollout.strategies.entropy_branch import global_samples
from rlbench.rollout.strategy import (
    RolloutStrategy,
    needs_groups,
    register_strategy,
    require_advantage_input,
    strategy_options,
)

log = logging.getLogger(__name__)

TURN_INPUTS = frozenset({"step_index", "turn_states", "turn_rewards"})
BRANCHES = ("none", "random_turn", "entropy_tool", "greedy_tree")
ATTRIBUTIONS = ("soft", "hard")
TREE_INPUT = "tree_nodes"


@dataclass(frozen=True)
class MultiTurnOptions:
    """The ``rollout.multi_turn`` block (module docstring): ``global_samples`` to ``branch_penalty`` are
    branch=entropy_tool's keys, ``dynamic_sampling`` to ``metric`` the episode filter's."""

    branch: str = "none"   # none: n independent episodes | random_turn: REFUEL's | entropy_tool: ARPO's | greedy_tree: AT-GRPO's
    global_samples: int | None = None  # N global episodes of the group's M = rollout.n; None: M // 2
    branch_width: int = 1               # Z branches per branch point
    entropy_tokens: int = 20            # k: tokens after an observation whose entropy decides
    alpha: float | None = None          # base branch probability; None: u ~ U(0, 1) per decision
    beta: float = 0.2                   # weight of the entropy rise
    threshold: float = 0.5              # tau: branch when P_t > tau
    attribution: str = "soft"           # soft: each branch trains its copy of the prefix | hard: shared tokens once
    branch_penalty: float = 0.0         # AEPO's consecutive-branch penalty: P_t * (1 - branch_penalty)^l; 0: ARPO's rule
    pre_monitor_beta: float | None = None  # AEPO's pre-monitoring: N from one probe episode's entropies; None: global_samples
    dynamic_sampling: bool = False  # keep only groups whose episodes differ (DAPO's filter), drawing more prompts
    max_rounds: int = 16   # with dynamic_sampling: rounds of episodes per step at most
    metric: str = "correct"  # with dynamic_sampling: correct (0 < #correct < n) | reward (the rewards differ)

    def filter_options(self) -> DynamicSamplingOptions | None:
        """DAPO's filter as rollout=dynamic_sampling takes it (its checks included); None without dynamic_sampling."""
        return DynamicSamplingOptions(self.max_rounds, self.metric) if self.dynamic_sampling else None

    @classmethod
    def from_config(cls, rollout: RolloutConfig) -> MultiTurnOptions:
        options = strategy_options(rollout, "multi_turn", cls)
        if options.branch not in BRANCHES:
            raise ConfigError(f"rollout.multi_turn.branch must be one of {BRANCHES}, got {options.branch!r}")
        if options.branch == "random_turn":
            needs_groups("multi_turn", rollout, "with branch=random_turn branches each episode into the group")
        if options.branch == "entropy_tool":
            needs_groups("multi_turn", rollout, "with branch=entropy_tool branches episodes into the group")
            options.check_entropy_tool(int(rollout.n))
        if options.branch == "greedy_tree":
            needs_groups("multi_turn", rollout, "with branch=greedy_tree samples rollout.n candidates of each turn")
        if options.pre_monitor_beta is not None and options.branch != "entropy_tool":
            raise ConfigError(f"rollout.multi_turn.pre_monitor_beta={options.pre_monitor_beta} splits an entropy_tool "
                              f"group's budget; it needs branch=entropy_tool, got branch={options.branch!r}")
        if options.dynamic_sampling:
            needs_groups("multi_turn", rollout, "with dynamic_sampling keeps groups whose episodes differ")
            if options.branch != "none":
                raise ConfigError("rollout.multi_turn.dynamic_sampling=true needs branch=none (a branched group's "
                                  "episodes share their roll-in; filtering them is not built)")
        return options

    def check_entropy_tool(self, n: int) -> None:
        """ConfigError for impossible branch=entropy_tool settings with a group of ``n`` episodes."""
        where = "rollout.multi_turn"
        if self.global_samples is not None and not 1 <= self.global_samples <= n:
            raise ConfigError(f"{where}.global_samples={self.global_samples} must be in [1, rollout.n={n}] (null: rollout.n // 2)")
        for key in ("branch_width", "entropy_tokens"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{where}.{key} must be >= 1, got {getattr(self, key)}")
        if not math.isfinite(self.beta) or (self.alpha is not None and not math.isfinite(self.alpha)) or math.isnan(self.threshold):
            raise ConfigError(f"{where}: alpha (or null) and beta must be finite numbers and threshold a number (.inf: never branch)")
        if not 0.0 <= self.branch_penalty <= 1.0:
            raise ConfigError(f"{where}.branch_penalty must be in [0, 1], got {self.branch_penalty}")
        if self.pre_monitor_beta is not None:
            if not math.isfinite(self.pre_monitor_beta):
                raise ConfigError(f"{where}.pre_monitor_beta must be a finite number or null, got {self.pre_monitor_beta}")
            if self.global_samples is not None:
                raise ConfigError(f"{where}: global_samples={self.global_samples} and pre_monitor_beta={self.pre_monitor_beta} "
                                  "both set the global episodes; keep one (null the other)")
        if self.attribution not in ATTRIBUTIONS:
            raise ConfigError(f"{where}.attribution must be one of {ATTRIBUTIONS}, got {self.attribution!r}")

    def globals_of(self, n: int) -> int:
        """N, the global episodes of a group of ``n``."""
        return self.global_samples if self.global_samples is not None else max(1, n // 2)


def branch_probability(entropy_rise: float, alpha: float | None, beta: float, threshold: float,
                       generator: torch.Generator | None, consecutive: int = 0, penalty: float = 0.0) -> float:
    """ARPO's P_t = alpha + beta * dH (arXiv:2507.19849, section 3), times AEPO's consecutive-branch penalty
    (1 - penalty)^l (arXiv:2510.14545, section 3; l = ``consecutive``: the branch points just before on the
    episode's path that all branched):

        P_t = (alpha + beta * dH) * (1 - penalty)^l

    alpha None: u ~ U(0, 1) from ``generator``, drawn only when it can decide (P_t's range over u straddles
    ``threshold``); else the range's lower end (u = 0)."""
    scale = (1.0 - penalty) ** consecutive
    low = beta * entropy_rise * scale
    if alpha is not None:
        return (alpha + beta * entropy_rise) * scale
    if low > threshold or low + scale <= threshold:
        return low
    return low + float(torch.rand((), generator=generator, dtype=torch.float64)) * scale


@dataclass
class Episode:
    """One episode as it runs: its environment, its prompt and its response so far (per token: the
    sampling log-prob, the loss mask, the turn, the state id and the turn's reward)."""

    problem: Problem
    env: Environment
    prompt_ids: tuple[int, ...] = ()
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    step_index: list[int] = field(default_factory=list)
    turn_states: list[int] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    state: int = 0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    total_reward: float = 0.0
    ended_by: str = ""
    seconds: float = 0.0
    trained_turn: int | None = None  # branch=random_turn: the one turn (0-based) whose tokens are trained
    node: int = -1  # branch=entropy_tool: the tree node of the tokens it adds now (-1: no tree)
    tree_nodes: list[int] = field(default_factory=list)
    initial_entropy: float | None = None  # branch=entropy_tool: H_0 of its root's first turn
    streak: int = 0  # branch=entropy_tool: the branch points just before on its path that all branched (AEPO's l)
    seed: int | None = None  # the episode's own random stream (evaluation: each turn's request seeded); None: the runner's generator

    @property
    def done(self) -> bool:
        return bool(self.ended_by)

    def add_turn(self, ids: list[int], logprobs: list[float]) -> None:
        self.response_ids += ids
        self.logprobs += logprobs
        self.loss_mask += [1] * len(ids)
        self.step_index += [self.turns] * len(ids)
        self.turn_states += [self.state] * len(ids)
        self.turn_rewards += [0.0] * len(ids)
        self.tree_nodes += [self.node] * len(ids)
        self.turns += 1

    def reward_turn(self, reward: float) -> None:
        """Record the reward of the turn just taken on its tokens."""
        self.total_reward += reward
        turn = self.turns - 1
        self.turn_rewards = [reward if s == turn else r for s, r in zip(self.step_index, self.turn_rewards)]

    def add_observation(self, ids: list[int]) -> None:
        self.response_ids += ids
        self.logprobs += [0.0] * len(ids)  # never read: loss mask 0
        self.loss_mask += [0] * len(ids)
        self.step_index += [-1] * len(ids)
        self.turn_states += [-1] * len(ids)
        self.turn_rewards += [0.0] * len(ids)
        self.tree_nodes += [self.node] * len(ids)

    def fork(self) -> Episode:
        """A branch from here: the same tokens so far, its own copy of the environment; its future turns
        are trained (``trained_turn``) and its reward counts from here on."""
        return dataclasses.replace(self, env=self.env.fork(), total_reward=0.0, trained_turn=self.turns, **self._lists())

    def _lists(self) -> dict[str, list]:
        return {name: list(getattr(self, name)) for name in
                ("response_ids", "logprobs", "loss_mask", "step_index", "turn_states", "turn_rewards", "tree_nodes")}

    def branch(self, count: int, new_node: Callable[[], int], hard: bool) -> list[Episode]:
        """ARPO's ``count`` branches from here (branch=entropy_tool): episodes of their own with the same
        tokens, counts and return so far and a copy of the environment, each in a new tree node
        (``new_node()``: a fresh id); this episode goes on in a new node too, so the tokens so far stay the
        shared node. ``hard``: a branch carries them as context (loss mask 0): trained once, here."""
        branches = []
        for _ in range(count):
            lists = self._lists()
            if hard:
                lists["loss_mask"] = [0] * len(self.loss_mask)
            branches.append(dataclasses.replace(self, env=self.env.fork(), node=new_node(), **lists))
        self.node = new_node()
        return branches

    def completion(self, tokenizer: Any) -> Completion:
        mask = list(self.loss_mask)
        if self.trained_turn is not None:
            mask = [m if turn == self.trained_turn else 0 for m, turn in zip(mask, self.step_index)]
        extras = {"step_index": list(self.step_index), "turn_states": list(self.turn_states),
                  "turn_rewards": list(self.turn_rewards)}
        if self.node >= 0:
            extras[TREE_INPUT] = list(self.tree_nodes)
        return Completion(
            request_index=0, prompt_ids=self.prompt_ids, response_ids=list(self.response_ids), logprobs=list(self.logprobs),
            finished=self.ended_by not in CUT_SHORT, text=tokenizer.decode(self.response_ids, skip_special_tokens=True),
            behaviour="policy", loss_mask=mask, extras=extras,
        )


#: end reasons of an episode cut short (its completion is not ``finished``: DAPO's overlong filter masks it)
CUT_SHORT = frozenset({"turn_cap", "tool_call_cap", "token_budget", "observation_too_long", "env_error", "env_timeout"})


def turn_length(new_ids: list[int], env: Environment, tokenizer: Any) -> int | None:
    """The number of ``new_ids`` that make up the turn: the fewest tokens whose text reaches the
    environment's turn end; None when the text never reaches it."""
    if env.turn_end(tokenizer.decode(new_ids, skip_special_tokens=True)) is None:
        return None
    for k in range(1, len(new_ids) + 1):
        if env.turn_end(tokenizer.decode(new_ids[:k], skip_special_tokens=True)) is not None:
            return k
    return len(new_ids)


@register_strategy("multi_turn")
class MultiTurnRollout(RolloutStrategy):
    """``rollout=multi_turn`` (module docstring); no state between steps."""

    provides = TURN_INPUTS | {TREE_INPUT}

    def __init__(self, setup: Any, options: MultiTurnOptions | None = None, filter_options: DynamicSamplingOptions | None = None):
        super().__init__(setup)
        self.options = options or MultiTurnOptions()
        self.filter_options = filter_options

    @classmethod
    def config_options(cls, rollout: RolloutConfig) -> dict[str, Any]:
        options = MultiTurnOptions.from_config(rollout)
        return {"options": options, "filter_options": options.filter_options()}

    @classmethod
    def validate(cls, rollout: RolloutConfig, advantage: str) -> None:
        """The options; the tree (``tree_nodes``) exists only with branch=entropy_tool, and its hard attribution
        needs an advantage that reads it."""
        options = MultiTurnOptions.from_config(rollout)
        if options.dynamic_sampling:
            refuse_tracker_baseline(advantage, "rollout.multi_turn.dynamic_sampling", "rollout.multi_turn.dynamic_sampling=false")
        tree = options.branch == "entropy_tool"
        if TREE_INPUT in ADVANTAGES.accepted_inputs(advantage) and not tree:
            raise ConfigError(f"advantage '{advantage}' reads {TREE_INPUT}, which rollout=multi_turn provides only with "
                              "rollout.multi_turn.branch=entropy_tool (ARPO's branches); set it, or pick another advantage")
        if tree and options.attribution == "hard":
            require_advantage_input(
                advantage, TREE_INPUT,
                "rollout.multi_turn.attribution=hard trains each shared token once and needs an advantage that gives it "
                "the mean advantage of the episodes below it; advantage '{advantage}' does not read the tree. Use "
                "algorithm/advantage=arpo_hard (readers of the tree: {readers}), or attribution=soft",
            )

    def rollout(
        self, problems: list[Problem], draw_prompts: Callable[[int], list[Problem]] | None = None
    ) -> tuple[GradedGroups, dict[str, float]]:
        if self.setup.env is None:
            raise ValueError("rollout=multi_turn needs an environment (env=<name>)")
        if self.filter_options is None:
            groups, metrics, _ = self.one_round(problems)
            return groups, metrics
        if draw_prompts is None:
            raise ValueError("multi_turn with dynamic_sampling draws more prompts: pass train_step(..., draw_prompts=sampler.next)")
        episodes: list[Episode] = []

        def sample(round_problems: list[Problem]) -> GradedGroups:
            groups, _, round_episodes = self.one_round(round_problems)
            episodes.extend(round_episodes)
            return groups

        groups, filter_metrics = sample_informative_groups(sample, draw_prompts, problems, self.filter_options,
                                                            "rollout.multi_turn.max_rounds")
        return groups, {**episode_metrics(episodes), **filter_metrics}

    def one_round(self, problems: list[Problem]) -> tuple[GradedGroups, dict[str, float], list[Episode]]:
        """The episodes of ``problems`` (``n`` each, or REFUEL's branches), graded, with their metrics."""
        start = time.perf_counter()
        runner = self.runner()
        branch_metrics: dict[str, float] = {}
        if self.options.branch == "random_turn":
            episodes, branch_metrics = self.branched(runner, problems, start)
            runner.run_to_end(episodes, start)
        elif self.options.branch == "entropy_tool":
            episodes, branch_metrics = self.entropy_branched(runner, problems, start)
        elif self.options.branch == "greedy_tree":
            problems, episodes, branch_metrics = self.greedy_tree(runner, problems, start)
        else:
            episodes = [runner.start(problem) for problem in problems for _ in range(self.setup.n)]
            runner.run_to_end(episodes, start)
        groups, metrics = self.graded(problems, episodes)
        return groups, {**metrics, **branch_metrics}, episodes

    def runner(self) -> EpisodeRunner:
        """The episode loop on this step's setup (its sampler, random stream and sampling parameters)."""
        setup = self.setup
        return EpisodeRunner(setup.env, setup.sampler.tokenizer, setup.sampler.prompt_spec,
                             lambda requests, params: setup.sampler.generate(requests, params, setup.generator), setup.params,
                             role_adapters(getattr(setup.sampler.engine, "model", None)))

    def branched(self, runner: EpisodeRunner, problems: list[Problem], start: float) -> tuple[list[Episode], dict[str, float]]:
        """REFUEL's groups (module docstring): per problem a roll-in to turn h - 1, then ``n`` forks."""
        turns = int(self.setup.env.config.max_turns)
        branch_turns = [1 + int(h) for h in torch.randint(turns, (len(problems),), generator=self.setup.generator)]
        roots = [runner.start(problem) for problem in problems]
        runner.run_to_end(roots, start, until=[h - 1 for h in branch_turns])
        missed = sum(root.done for root in roots)
        episodes = [root.fork() for root in roots for _ in range(self.setup.n)]
        return episodes, {"multi_turn_branch_turn": sum(branch_turns) / max(len(problems), 1),
                          "multi_turn_branch_missed": float(missed)}

    def entropy_branched(self, runner: EpisodeRunner, problems: list[Problem], start: float) -> tuple[list[Episode], dict[str, float]]:
        """ARPO's groups (module docstring): N global episodes per problem, branches where the entropy after an
        observation rises, global episodes to fill a group short of M; the episodes run to their ends."""
        setup, options = self.setup, self.options
        budget, k, hard = setup.n, options.entropy_tokens, options.attribution == "hard"
        new_node = itertools.count().__next__
        monitored: list[int] = []
        if options.pre_monitor_beta is None:
            groups = [[runner.start(problem) for _ in range(options.globals_of(budget))] for problem in problems]
        else:  # a probe per prompt, run to its end without branching, measures; it is not trained
            probes = [runner.start(problem) for problem in problems]
            runner.run_to_end(probes, start)
            monitored = self.monitored_globals(probes, budget)
            groups = [[runner.start(problem) for _ in range(count)] for problem, count in zip(problems, monitored)]
        home = {id(e): group for group in groups for e in group}
        everyone = [e for group in groups for e in group]
        for e in everyone:
            e.node = new_node()
        rises: list[float] = []
        forked_at: dict[int, int] = {}
        branches = filled = 0

        def decide(active: list[Episode], new_turns: list[list[int]]) -> None:
            """Before the turns just generated are added: branch the episodes whose turn follows an observation
            with a high entropy rise (each branch generates its own turn next round)."""
            nonlocal branches
            candidates = [(e, new[:k]) for e, new in zip(active, new_turns)
                          if e.turns >= 1 and new and len(home[id(e)]) < budget and forked_at.get(id(e)) != len(e.response_ids)]
            if not candidates:
                return
            items = [(e.prompt_ids, tuple(e.response_ids) + tuple(head)) for e, head in candidates]
            for (e, head), stats in zip(candidates, setup.sampler.engine.position_stats(items, setup.params)):
                entropy = stats.entropy.to(torch.float64) / math.log(stats.vocab_size)
                if e.initial_entropy is None:
                    first = [t for t, turn in enumerate(e.step_index) if turn == 0][:k]
                    e.initial_entropy = float(entropy[first].mean())
                group = home[id(e)]
                if len(group) >= budget:  # filled by an earlier branch this round
                    continue
                rise = float(entropy[len(e.response_ids):].mean()) - e.initial_entropy
                rises.append(rise)
                p = branch_probability(rise, options.alpha, options.beta, options.threshold, setup.generator,
                                       e.streak, options.branch_penalty)
                e.streak = e.streak + 1 if p > options.threshold else 0  # its branches inherit it
                if p > options.threshold:
                    new = e.branch(min(options.branch_width, budget - len(group)), new_node, hard)
                    group += new
                    everyone.extend(new)
                    home.update((id(b), group) for b in new)
                    forked_at.update((id(b), len(b.response_ids)) for b in new)  # their point is decided
                    branches += len(new)

        while True:
            runner.run_to_end(everyone, start, decide=decide)
            short = [(problem, group) for problem, group in zip(problems, groups) if len(group) < budget]
            if not short:
                break
            for problem, group in short:  # every episode of the group ended before M: global samples fill it
                more = [runner.start(problem) for _ in range(budget - len(group))]
                for e in more:
                    e.node = new_node()
                    home[id(e)] = group
                group += more
                everyone.extend(more)
                filled += len(more)
        metrics = {"multi_turn_branch_decisions": float(len(rises)), "multi_turn_branches": float(branches),
                   "multi_turn_branch_filled": float(filled),
                   "multi_turn_branch_entropy_rise": sum(rises) / len(rises) if rises else 0.0}
        if monitored:
            metrics["multi_turn_branch_globals"] = sum(monitored) / len(monitored)
        return [e for group in groups for e in group], metrics

    def monitored_globals(self, probes: list[Episode], budget: int) -> list[int]:
        """AEPO's pre-monitoring (module docstring): each finished probe's N from H_root (its first turn's first k
        tokens) and H_tool (the mean over its later turns of their first k tokens), normalised entropies."""
        k, beta = self.options.entropy_tokens, self.options.pre_monitor_beta
        items = [(e.prompt_ids, tuple(e.response_ids)) for e in probes]
        counts = []
        for e, stats in zip(probes, self.setup.sampler.engine.position_stats(items, self.setup.params)):
            entropy = stats.entropy.to(torch.float64) / math.log(stats.vocab_size)
            heads = [[t for t, turn in enumerate(e.step_index) if turn == i][:k] for i in range(e.turns)]
            turn_entropy = [float(entropy[head].mean()) for head in heads if head]
            root = turn_entropy[0] if turn_entropy else 0.0
            tool = sum(turn_entropy[1:]) / len(turn_entropy[1:]) if len(turn_entropy) > 1 else root
            counts.append(global_samples(budget, root, tool, beta))
        return counts

    def greedy_tree(self, runner: EpisodeRunner, problems: list[Problem], start: float
                    ) -> tuple[list[Problem], list[Episode], dict[str, float]]:
        """AT-GRPO's greedy trees (module docstring): per problem, turn after turn, K = ``n`` candidates forked
        from the tree's current episode take one turn (one engine call for every tree's candidates); the best
        (:func:`greedy_best`) becomes the current episode. Returns a problem and a group of K candidates per
        (problem, turn), problem after problem, turn after turn."""
        n = self.setup.n
        current = [runner.start(problem) for problem in problems]
        trees: list[list[list[Episode]]] = [[] for _ in problems]
        ties = 0
        while live := [i for i, e in enumerate(current) if not e.done]:
            candidates = {i: [current[i].fork() for _ in range(n)] for i in live}
            runner.advance([c for i in live for c in candidates[i]])
            now = time.perf_counter() - start
            for i in live:
                turn = candidates[i]
                for c in turn:
                    c.seconds = now
                best = greedy_best([c.total_reward for c in turn])
                ties += sum(c.total_reward == turn[best].total_reward for c in turn) > 1
                trees[i].append(turn)
                current[i] = turn[best]
        for tree in trees:  # a candidate that did not end its episode took its turn: that is its end here
            for turn in tree:
                for c in turn:
                    c.ended_by = c.ended_by or "tree_turn"
        turns = [len(tree) for tree in trees]
        return ([problem for problem, k in zip(problems, turns) for _ in range(k)],
                [c for tree in trees for turn in tree for c in turn],
                {"multi_turn_tree_turns": sum(turns) / max(len(turns), 1), "multi_turn_tree_ties": float(ties)})

    def graded(self, problems: list[Problem], episodes: list[Episode]) -> tuple[GradedGroups, dict[str, float]]:
        """The episodes as graded groups (one per problem) and the step's multi-turn metrics."""
        sampler, n = self.setup.sampler, self.setup.n
        completions = [e.completion(sampler.tokenizer) for e in episodes]
        groups = [completions[i * n : (i + 1) * n] for i in range(len(problems))]
        grades = [grade_episode(e, self.setup.env.config.name) for e in episodes]
        outcome = torch.tensor([g.reward for g in grades], dtype=torch.float32)
        inputs = shaping_inputs(problems, groups, grades, self.setup.env.config.max_tokens, sampler.tokenizer)
        inputs["response_lengths"] = torch.tensor([sum(c.loss_mask) for c in completions], dtype=torch.long)
        inputs["policy_code"] = [policy_code("".join(turn["policy"] for turn in episode_turns(e, sampler.tokenizer))) for e in episodes]
        rewards = sampler.shape_rewards(outcome, inputs).to(torch.float32)
        graded = GradedGroups(list(problems), groups, grades, rewards, outcome, inputs["finished"], list(range(len(groups))))
        return graded, episode_metrics(episodes)


@dataclass
class EpisodeRunner:
    """The episode loop (module docstring), one for training and evaluation: rollout=multi_turn runs its
    step's episodes with it, and the evaluation (rlbench.eval.evaluate, with ``env`` set) runs each sampled
    answer as an episode with it. ``env`` is the EnvFactory (its ``config``: the caps), ``prompt_spec`` the
    prompt templates whose system message heads the prompt, ``generate(requests, params)`` the engine call
    (training: the sampler's, with the step's generator; evaluation: the engine's, every request seeded),
    ``params`` the sampling parameters (the turn's budget is ``env.turn_tokens``), ``adapters`` a per-role LoRA
    policy's role adapters (rlbench.model.lora.role_adapters: each turn is sampled with its role's, the whole
    episode so far run through it; (): one policy for every turn)."""

    env: Any
    tokenizer: Any
    prompt_spec: Any
    generate: Callable[[list[GenerationRequest], SamplingParams], list[list[Completion]]]
    params: SamplingParams
    adapters: tuple[str, ...] = ()

    def run_to_end(self, episodes: list[Episode], start: float, until: list[int] | None = None,
                   decide: Callable[[list[Episode], list[list[int]]], None] | None = None) -> None:
        """Advance ``episodes`` together until each is done (or, with ``until``, has taken ``until[i]`` turns);
        ``decide``: :meth:`advance`'s hook (it may append branches to ``episodes``, which run too)."""
        while active := [e for i, e in enumerate(episodes) if not e.done and e.turns != (until[i] if until else -1)]:
            self.advance(active, decide)
            now = time.perf_counter() - start
            for e in active:
                if e.done:
                    e.seconds = now

    def start(self, problem: Problem, seed: int | None = None) -> Episode:
        """A new episode: its environment, reset, and the prompt: the dataset's system message (if any)
        and, as the user message, the environment's first observation alone (the dataset's user template
        asks for a single-turn answer). ``seed``: the episode's own random stream (evaluation; each turn's
        request draws from :func:`turn_seed` of it); None: the runner's generator."""
        env = self.env()
        first = env.reset(problem)
        messages = build_messages(problem, self.prompt_spec)
        system = messages[0]["content"] if messages[0]["role"] == "system" else None
        spec = {"system": system, "user": "{problem}"}
        prompt = encode_prompts(self.tokenizer, [dataclasses.replace(problem, prompt=first.observation)], spec)[0]
        return Episode(problem, env, tuple(prompt), state=state_id(first.state_key), seed=seed)

    def advance(self, active: list[Episode], decide: Callable[[list[Episode], list[list[int]]], None] | None = None) -> None:
        """One turn of every episode in ``active``: generate (one engine call), cut each at its turn end, then
        step the environments (in parallel, ``env.workers`` at once, each bounded by ``env.step_timeout_s``).
        ``decide(active, new tokens)`` sees each episode's new tokens before they are added (ARPO's branching)."""
        caps, tokenizer = self.env.config, self.tokenizer
        params = dataclasses.replace(self.params, max_new_tokens=caps.turn_tokens)
        requests = [GenerationRequest(e.prompt_ids, 1, prefix_ids=tuple(e.response_ids), score_prefix=False,
                                      seed=None if e.seed is None else turn_seed(e.seed, e.turns),
                                      adapter=turn_adapter(self.adapters, e.turns) if self.adapters else None) for e in active]
        completions = [c for (c,) in self.generate(requests, params)]
        if decide is not None:
            decide(active, [c.response_ids[len(e.response_ids):] for e, c in zip(active, completions)])
        turns = []
        for e, c in zip(active, completions):
            new, logprobs = c.response_ids[len(e.response_ids):], c.logprobs[len(e.response_ids):]
            room = caps.max_tokens - len(e.response_ids)
            k = turn_length(new, e.env, tokenizer)
            stopped = c.finished and k is None  # EOS ended the turn (a cut turn never keeps its EOS)
            k = len(new) if k is None else k
            if k > room:
                k, stopped = room, False
            e.add_turn(new[:k], logprobs[:k])
            turns.append((e, tokenizer.decode(new[:k], skip_special_tokens=True), stopped))
        calls = [lambda env=e.env, text=text: env.step(text) for e, text, _ in turns]
        workers = caps.workers or os.cpu_count() or 1
        for (e, _, stopped), outcome in zip(turns, call_all_with_timeout(calls, caps.step_timeout_s, workers)):
            self.apply(e, outcome, stopped)

    def apply(self, e: Episode, outcome: tuple[Any, BaseException | None], stopped: bool) -> None:
        """Apply the environment's answer to the turn just taken (``outcome``: its StepResult or the
        exception it raised), or end the episode."""
        caps = self.env.config
        result, error = outcome
        if isinstance(error, EnvTimeout):
            e.ended_by = "env_timeout"
            return
        if error is not None:  # an environment's failure ends its episode only
            log.warning("environment %s raised %s: %s; the episode ends", caps.name, type(error).__name__, error)
            e.ended_by = "env_error"
            return
        result: StepResult
        e.reward_turn(float(result.reward))
        e.tool_calls += result.tool_calls
        e.tool_errors += result.tool_errors
        e.state = state_id(result.state_key)
        if result.done:
            e.ended_by = result.ended_by or "done"
        elif stopped and e.env.eos_ends_episode:
            e.ended_by = "model_stopped"
        elif e.turns >= caps.max_turns:
            e.ended_by = "turn_cap"
        elif result.tool_calls and e.tool_calls >= caps.max_tool_calls and not e.env.answers_after_last_call:
            e.ended_by = "tool_call_cap"
        else:
            ids = self.tokenizer.encode(result.observation, add_special_tokens=False)
            if len(ids) > caps.max_observation_tokens:
                e.ended_by = "observation_too_long"
            elif len(e.response_ids) + len(ids) >= caps.max_tokens:
                e.ended_by = "token_budget"
            else:
                e.add_observation(ids)


def greedy_best(rewards: list[float]) -> int:
    """AT-GRPO's greedy choice (arXiv:2510.11062, section 3): the candidate with the highest turn reward,
    ties to the first (sampling order), so the choice is deterministic given the rewards."""
    return max(range(len(rewards)), key=lambda j: (rewards[j], -j))


def grade_episode(e: Episode, env_name: str) -> Grade:
    """The environment's verdict on a finished episode (``Environment.grade`` of its return); an environment
    that fails to grade scores the episode 0 (the error kept on the grade). Training and evaluation grade
    an episode with it."""
    try:
        return e.env.grade(e.total_reward)
    except Exception as error:  # noqa: BLE001 - counted as an environment error, graded 0
        log.warning("environment %s could not grade an episode: %s", env_name, error)
        return Grade(correct=False, extracted=None, reward=0.0, format_ok=False, error=str(error))


def turn_seed(episode_seed: int, turn: int) -> int:
    """The seed of an episode's turn ``turn`` (0-based) when the episode has its own stream (evaluation)."""
    digest = hashlib.sha256(f"{int(episode_seed)}\0turn\0{int(turn)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 2


def episode_turns(e: Episode, tokenizer: Any) -> list[dict[str, Any]]:
    """The episode turn by turn: per policy turn its number (from 1), the policy's text and the observation
    the environment answered with (empty after the last turn), as the evaluation's samples file shows them."""
    segments: list[tuple[int, list[int], list[int]]] = []  # (turn, policy tokens, observation tokens)
    for token, step in zip(e.response_ids, e.step_index):
        if step >= 0 and (not segments or segments[-1][0] != step):
            segments.append((step, [], []))
        if segments:
            (segments[-1][1] if step >= 0 else segments[-1][2]).append(token)
    return [{"turn": turn + 1, "policy": tokenizer.decode(policy, skip_special_tokens=True),
             "observation": tokenizer.decode(observed, skip_special_tokens=True)} for turn, policy, observed in segments]


def episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    """Means per episode (turns, tool calls, tool errors, seconds), the observation-token share and
    the count of each end reason."""
    count = max(len(episodes), 1)
    tokens = sum(len(e.response_ids) for e in episodes)
    observed = sum(len(e.loss_mask) - sum(e.loss_mask) for e in episodes)
    metrics = {
        "multi_turn_turns": sum(e.turns for e in episodes) / count,
        "multi_turn_tool_calls": sum(e.tool_calls for e in episodes) / count,
        "multi_turn_tool_errors": sum(e.tool_errors for e in episodes) / count,
        "multi_turn_episode_s": sum(e.seconds for e in episodes) / count,
        "multi_turn_observation_share": observed / max(tokens, 1),
    }
    metrics.update({f"multi_turn_ended_{reason}": float(k) for reason, k in sorted(Counter(e.ended_by for e in episodes).items())})
    return metrics
