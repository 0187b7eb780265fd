"""Each step input is declared once (rlbench/algorithm/step_inputs.py), and everything else follows from it.

The demo: a new input that a rollout strategy provides, added in three places (the producer: its entry
and the strategy that fills it; the advantage piece; the piece's YAML), runs one step through the real
runner on the tiny model, and the advantage sees exactly what the strategy produced. Then the drift
checks (every input a registered piece declares has its entry and its producer) and the refusals.
"""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from omegaconf import OmegaConf, open_dict

import rlbench.runner as runner
import rlbench.training.step  # noqa: F401  (registers every piece, strategy and source)
from rlbench.algorithm.advantages import grpo_advantage
from rlbench.algorithm.registry import ADVANTAGES, AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES
from rlbench.algorithm.shaping import REWARD_SHAPING
from rlbench.algorithm.step_inputs import PRODUCERS, STEP_INPUTS, StepInput
from rlbench.validation import validate_config
from rlbench.errors import ConfigError
from rlbench.rollout.strategies.iid import IIDSampling
from rlbench.rollout.strategy import STRATEGIES, register_strategy
from rlbench.training.advantage_inputs import SOURCES
from rlbench.training.batch import TrainBatch

PIECE_REGISTRIES = (ADVANTAGES, POLICY_LOSSES, AGGREGATIONS, KL_ESTIMATORS, REWARD_SHAPING)

# Place 3 of 3: the piece's YAML (conf/algorithm/advantage/parity_bonus.yaml in the repository).
PARITY_BONUS_YAML = """
name: parity_bonus
bonus: 0.5   # added to the advantage of every even response token
"""


def add_token_parity_input(produced: list, seen: list) -> None:
    """The whole addition of a strategy-provided step input and an advantage that reads it."""

    # Place 1 of 3, the producer (a strategy module): the input's entry and the strategy that fills it.
    STEP_INPUTS.register(StepInput(
        "token_parity", "[B,T] long", "1 on even response token ids, 0 on odd ones, -1 on padding",
        producer="strategy", readers=frozenset({"advantage"}), dtype=torch.long, pad=-1,
    ))

    @register_strategy("parity")
    class ParitySampling(IIDSampling):
        """i.i.d. responses, each token marked with its id's parity."""

        provides = frozenset({"token_parity"})

        def rollout(self, problems, draw_prompts=None):
            graded, metrics = super().rollout(problems, draw_prompts)
            for completion in (c for group in graded.groups for c in group):
                completion.extras["token_parity"] = [1 - token % 2 for token in completion.response_ids]
                produced.append(completion.extras["token_parity"])
            return graded, metrics

    # Place 2 of 3, the piece (a module of rlbench/algorithm/advantages/).
    @ADVANTAGES.register("parity_bonus", advantage_level="token")
    def parity_bonus_advantage(rewards, group_index, response_mask, token_parity, bonus: float = 0.5):
        """A toy token-level advantage: GRPO's (r_i - mean_G r) / (std_G r + eps) plus ``bonus`` on every
        even response token, A_it = A_i^GRPO + bonus * 1[o_it even]."""
        seen.append(token_parity.clone())
        return grpo_advantage(rewards, group_index, response_mask) + bonus * token_parity.clamp(min=0) * response_mask


@pytest.fixture
def token_parity():
    """(responses' parities as the strategy produced them, token_parity as the advantage saw it); the
    registries are restored afterwards, so the toy pieces are seen by no other test."""
    live = (STEP_INPUTS._entries, ADVANTAGES._functions, ADVANTAGES._needs, STRATEGIES)
    saved = [dict(registry) for registry in live]
    produced, seen = [], []
    add_token_parity_input(produced, seen)
    yield produced, seen
    for registry, before in zip(live, saved):
        registry.clear()
        registry.update(before)


def parity_cfg(make_cfg, *overrides):
    cfg = make_cfg("experiment=smoke", "logger=files", "trainer.save_model=false", "eval.before_training=false",
                   "eval.n=1", "eval.k=[1]", "eval.limit=1", "trainer.steps=1", *overrides)
    with open_dict(cfg):
        cfg.algorithm.advantage = OmegaConf.create(PARITY_BONUS_YAML)
    return cfg


@pytest.mark.slow
def test_a_strategy_provided_input_reaches_its_advantage_through_the_real_step(make_cfg, tmp_path, token_parity):
    produced, seen = token_parity
    runner.run(parity_cfg(make_cfg, "rollout.strategy=parity"))
    (step,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert "advantage_std" in step
    (parity,) = seen  # one step, one advantage call
    assert parity.dtype == torch.long and parity.shape[0] == len(produced)
    for row, values in enumerate(produced):  # exactly what the strategy produced, padded with the entry's -1
        assert parity[row, : len(values)].tolist() == values
        assert (parity[row, len(values):] == -1).all()
    assert any(1 in values for values in produced) and any(0 in values for values in produced)


def test_a_strategy_input_without_its_strategy_is_refused_naming_the_strategies(make_cfg, token_parity):
    with pytest.raises(ConfigError, match=r"reads token_parity .*only the rollout strategies \['parity'\] do\. Select rollout=parity"):
        validate_config(parity_cfg(make_cfg))
    validate_config(parity_cfg(make_cfg, "rollout.strategy=parity"))


@pytest.mark.parametrize("advantage,strategies", [("tree", "rollout=multi_turn or rollout=tree or rollout=treerpo"), ("vine", "rollout=vine")])
def test_the_built_in_strategy_inputs_are_refused_the_same_way(make_cfg, advantage, strategies):
    with pytest.raises(ConfigError, match=f"Select {strategies}, or another advantage"):
        validate_config(make_cfg("experiment=toy_learning/grpo", f"algorithm/advantage={advantage}"))


def test_every_input_a_registered_piece_requires_is_a_step_input_of_its_kind():
    """No piece needs a name that nothing provides (the drift the separate lists had: tree_nodes)."""
    for registry in PIECE_REGISTRIES:
        for name in registry.names():
            parameters = inspect.signature(registry.get(name)).parameters.values()
            required = {p.name for p in parameters if p.default is inspect.Parameter.empty}
            assert required <= registry.inputs, f"{registry.kind} '{name}' requires {sorted(required - registry.inputs)}"
    assert {"tree_nodes", "step_index", "step_values"} <= ADVANTAGES.inputs


def test_every_step_input_has_its_producer():
    assert {entry.producer for entry in STEP_INPUTS} <= set(PRODUCERS)
    # sources: each source input has exactly its registered source class, and the reverse
    assert set(SOURCES) == STEP_INPUTS.names(producer="source")
    # strategies: what a registered strategy provides is a strategy input, and each one has a strategy
    provided = {name for cls in STRATEGIES.values() for name in cls.provides}
    assert provided == STEP_INPUTS.names(producer="strategy")
    # the batch: each batch input is a TrainBatch attribute, and so is each graded input the loss step reads
    batch_attributes = {name for name, _ in inspect.getmembers(TrainBatch)} | set(TrainBatch.__dataclass_fields__)
    assert STEP_INPUTS.names(producer="batch") <= batch_attributes
    assert STEP_INPUTS.names("loss", "objective", producer="graded") <= batch_attributes


def test_entries_are_declared_once():
    entry = STEP_INPUTS["tree_nodes"]
    assert STEP_INPUTS.register(entry) is entry  # the same entry again: a no-op
    with pytest.raises(ValueError, match="already registered"):
        STEP_INPUTS.register(StepInput("tree_nodes", "[B]", "another meaning", "source", frozenset({"advantage"})))
    with pytest.raises(ValueError, match="producer must be one of"):
        StepInput("x", "[B]", "doc", "elsewhere", frozenset({"advantage"}))


def test_the_loss_step_passes_only_step_inputs():
    """compute_loss takes the loss step's inputs by name (readers loss and objective): another name is refused."""
    from conftest import algorithm_from

    algorithm = algorithm_from(OmegaConf.create({
        "advantage": {"name": "grpo"}, "loss": {"name": "ppo_clip"}, "aggregation": {"name": "token_mean"}}))
    logp = torch.zeros(1, 2)
    norms = {"batch_tokens": 2, "batch_sequences": 1, "norm_length": 2}
    loss, _ = algorithm.compute_loss(norms=norms, logp=logp, old_logp=logp, advantages=torch.ones(1, 2),
                                     response_mask=torch.ones(1, 2))
    assert loss.item() == pytest.approx(-1.0)
    with pytest.raises(TypeError, match=r"\['tree_nodes'\]"):
        algorithm.compute_loss(norms=norms, logp=logp, old_logp=logp, advantages=torch.ones(1, 2),
                               response_mask=torch.ones(1, 2), tree_nodes=torch.zeros(1, 2))
