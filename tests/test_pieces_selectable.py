"""Every registered piece can be chosen from the command line, and the parameter values a piece's
YAML sets cannot drift from the function's defaults.

A piece YAML (conf/algorithm/<kind>/<option>.yaml) restates the function's defaults so that they
are visible and overridable; a value that deliberately differs carries a ``# preset:`` comment on
its line saying why. Parameters without a default (inputs bound in YAML, e.g. norm_length) are
exempt: there is nothing to drift from."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from rlbench.algorithm.schedules import SCHEDULES
from rlbench.validation import validate_config
from rlbench.listing import group_options, main as list_main
from rlbench.algorithm.pieces import PIECE_KINDS
from rlbench.algorithm.registry import POLICY_LOSSES
from rlbench.rollout import STRATEGIES

from conftest import CONF_DIR, ROOT

GROUP_KINDS = ("advantage", "loss", "aggregation")  # chosen with algorithm/<kind>=<option>
# What a piece needs beside it to be valid (the validator's refusal names the same companion).
COMPANIONS = {
    ("advantage", "gae"): ["algorithm=ppo"],  # needs the value head of the ppo preset
    ("advantage", "polychromic"): ["rollout.n=8"],  # needs rollout.n > set_size=4
    ("loss", "degrpo"): ["algorithm/aggregation=seq_mean_token_sum"],
    # the pairwise losses read whole groups and take only their mean over groups
    **{("loss", name): ["algorithm/aggregation=group_mean"] for name in POLICY_LOSSES.names() if POLICY_LOSSES.needs(name).whole_groups},
    ("loss", "sacpo"): ["algorithm/aggregation=group_mean", "+algorithm.reincarnate_at=2"],  # and its stage switch
    ("advantage", "tree"): ["rollout=tree"],  # reads the tree of a tree rollout
    ("advantage", "treerpo"): ["rollout=treerpo"],
    ("advantage", "vine"): ["rollout=vine"],  # reads the Monte-Carlo step values of rollout=vine
    # reads the prefix depths of rollout=mcts_prefix, whose default 2 segments of 4 tokens need 12 new tokens
    ("advantage", "sae"): ["rollout=mcts_prefix", "rollout.max_new_tokens=12"],
    ("advantage", "gigpo"): ["rollout=multi_turn", "env=gridworld"],  # reads the turns of multi-turn episodes
    ("advantage", "at_grpo"): ["rollout=multi_turn", "env=gridworld"],  # reads each turn (its role) of an episode
    ("advantage", "gtpo_turn"): ["rollout=multi_turn", "env=gridworld"],  # reads each turn's reward of an episode
    ("advantage", "poad"): ["algorithm=poad"],  # the value head and the multi-turn actions of the poad preset
    ("advantage", "arpo_hard"): ["algorithm=arpo", "rollout.multi_turn.attribution=hard"],  # ARPO's branch tree
    ("advantage", "oprl"): ["algorithm=oprl"],  # the online PRM (algorithm.online_prm) and the turns of the oprl preset
    ("loss", "ppo_clip_sft"): ["rollout=rethink"],  # reads the SFT targets rollout=rethink marks
    # reads the steps of rollout=vine, whose advantage reads vine's values; a sum over steps per response
    ("loss", "direct_advantage_po"): ["rollout=vine", "algorithm/advantage=vine", "algorithm/aggregation=seq_mean_token_sum"],
}
PRESET_MARK = re.compile(r"#\s*preset:")


def registered(kinds):
    return [(kind, name) for kind in kinds for name in PIECE_KINDS[kind].registry.names()]


@pytest.fixture(scope="module")
def compose_smoke(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("pieces")
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        yield lambda *overrides: compose(
            "config", overrides=["experiment=smoke", f"output_dir={output_dir}", *overrides]
        )


@pytest.mark.parametrize("kind,name", registered(GROUP_KINDS))
def test_every_registered_piece_has_a_yaml_option_that_composes_and_validates(compose_smoke, kind, name):
    assert (ROOT / "conf" / "algorithm" / kind / f"{name}.yaml").is_file(), f"algorithm/{kind}={name} has no YAML"
    cfg = compose_smoke(*COMPANIONS.get((kind, name), []), f"algorithm/{kind}={name}")
    assert cfg.algorithm[kind].name == name
    algorithm = validate_config(cfg)
    assert getattr(algorithm, kind).name == name


@pytest.mark.parametrize("name", PIECE_KINDS["kl_estimator"].registry.names())
def test_every_kl_estimator_is_a_plain_override(compose_smoke, name):
    algorithm = validate_config(compose_smoke("algorithm.kl.coef=0.01", f"algorithm.kl.estimator={name}"))
    assert algorithm.kl_estimator == name and algorithm.kl_in_loss


@pytest.mark.parametrize("name", PIECE_KINDS["reward_shaping"].registry.names())
def test_every_reward_shaping_function_is_a_plain_override(compose_smoke, name):
    algorithm = validate_config(compose_smoke(f"algorithm.reward_shaping=[{{name: {name}}}]"))
    assert [piece.name for piece in algorithm.reward_shaping] == [name]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_update_schedule_is_a_plain_override(compose_smoke, schedule):
    assert validate_config(compose_smoke(f"algorithm.update.schedule={schedule}")).schedule == schedule


def test_every_yaml_option_names_a_registered_piece():
    for kind in GROUP_KINDS:
        for option in group_options()[f"algorithm/{kind}"]:
            assert OmegaConf.load(ROOT / "conf" / "algorithm" / kind / f"{option}.yaml").name in PIECE_KINDS[kind].registry


def piece_yaml_drift(path: Path, kind: str) -> list[str]:
    """The parameters a piece YAML sets to a value other than the function's default, unmarked."""
    values = OmegaConf.to_container(OmegaConf.load(path))
    parameters = inspect.signature(PIECE_KINDS[kind].registry.get(values.pop("name"))).parameters
    marked = {line.split(":")[0].strip() for line in path.read_text().splitlines() if PRESET_MARK.search(line)}
    return [
        f"{path.name}: {key}={value!r}, the function's default is {parameters[key].default!r}"
        for key, value in values.items()
        if parameters[key].default is not inspect.Parameter.empty and value != parameters[key].default and key not in marked
    ]


@pytest.mark.parametrize("kind", GROUP_KINDS)
def test_piece_yaml_values_equal_the_function_defaults(kind):
    drift = [line for path in sorted((ROOT / "conf" / "algorithm" / kind).glob("*.yaml")) for line in piece_yaml_drift(path, kind)]
    assert not drift, "\n".join(drift)


def test_a_drifted_yaml_value_is_caught_unless_marked(tmp_path):
    drifted = tmp_path / "ppo_clip.yaml"
    drifted.write_text("name: ppo_clip\nclip_low: 0.2\nclip_high: 0.3\n")
    assert piece_yaml_drift(drifted, "loss") == ["ppo_clip.yaml: clip_high=0.3, the function's default is 0.2"]
    drifted.write_text("name: ppo_clip\nclip_high: 0.3  # preset: clip-higher\n")
    assert piece_yaml_drift(drifted, "loss") == []


def test_the_listing_shows_every_group_option_and_piece(capsys):
    list_main([])
    listing = capsys.readouterr().out
    for group, options in group_options().items():
        assert f"{group}: {' '.join(options)}" in listing
    for kind, name in registered(PIECE_KINDS):
        assert f"  {name}(" in listing
    assert "algorithm.update.schedule): standard sfpo trpo" in listing
    for name in STRATEGIES:
        assert f"  {name}: " in listing


def test_the_listing_shows_the_keys_of_a_node_with_their_help(capsys):
    list_main(["--keys", "algorithm.kl"])
    keys = capsys.readouterr().out
    assert "algorithm.kl.placement = 'loss': " in keys and "algorithm.kl.adaptive.horizon" in keys
    with pytest.raises(SystemExit, match="not a config node"):
        list_main(["--keys", "algorithm.kll"])
