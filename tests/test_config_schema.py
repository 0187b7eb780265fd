"""The schema walk (rlbench/config/walk.py): unknown keys anywhere, with the nearest spelling and
where the value came from; wrong types, choices and bounds; piece parameters from the registry's
signatures. Compose + check only: nothing is loaded."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from rlbench.algorithm.critic import CriticSettings
from rlbench.algorithm.entropy import AdaptiveEntropy
from rlbench.algorithm.sampling_correction import SamplingCorrection
from rlbench.algorithm.schedules import SFPOSettings, TRPOSettings
from rlbench.validation import registered, validate_config
from rlbench.config.origin import ValueOrigins, composed_files, override_key, with_origins
from rlbench.config.schema import (
    AdaptiveEntropyConfig, AlgorithmConfig, CriticConfig, RolloutConfig, RunConfig,
    SamplingCorrectionConfig, SFPOConfig, TrainerConfig, TRPOConfig,
)
from rlbench.config.typed import rollout_config, typed_config
from rlbench.config.walk import check_against_schema, nearest
from rlbench.errors import ConfigError
from rlbench.rollout.strategy import STRATEGIES

from conftest import ROOT

NO_ORIGINS = ValueOrigins()


def refused(cfg, origins=NO_ORIGINS) -> str:
    with pytest.raises(ConfigError) as err:
        check_against_schema(cfg, registered(), origins)
    return str(err.value)


@pytest.mark.parametrize("override,key,suggestion", [
    ("++trainer.lrr=1", "lrr", "lr"),
    ("+trainer.lrr=1", "lrr", "lr"),
    ("++algorithm.kl.placment=reward", "placment", "placement"),
    ("++algorithm.entropy_coeff=0.1", "entropy_coeff", "entropy_coef"),
    ("++algorithm.update.epoch=4", "epoch", "epochs"),
    ("++algorithm.overlong_filtr=true", "overlong_filtr", "overlong_filter"),
    ("++sandbox.timeout=1", "timeout", "timeout_s"),
    ("++eval.benchmarks.arith.limt=2", "limt", "limit"),
    ("++seeed=1", "seeed", "seed"),
])
def test_an_unknown_key_is_refused_with_its_nearest_spelling(make_cfg, override, key, suggestion):
    message = refused(make_cfg("experiment=smoke", override))
    assert f"'{key}'" in message and f"did you mean '{suggestion}'?" in message


def test_the_message_says_which_override_set_the_key(make_cfg):
    overrides = ("experiment=smoke", "++trainer.lrr=1")
    origins = ValueOrigins(overrides, ())
    assert "(set by the command-line override '++trainer.lrr=1')" in refused(make_cfg(*overrides), origins)


def test_origins_trace_a_key_to_the_last_file_that_sets_it():
    # hydra.runtime.choices lists the last merged option first
    choices = {"paper": "dapo", "experiment": "smoke", "algorithm": "dapo", "algorithm/loss": "ppo_clip",
               "benchmark@eval.benchmarks.gsm8k": "gsm8k", "hydra/launcher": "basic"}
    origins = ValueOrigins(("algorithm=dapo", "trainer.lr=1"), tuple(composed_files(choices)))
    assert origins.of("algorithm.loss.clip_high") == "conf/paper/dapo.yaml (paper=dapo)"
    assert origins.of("algorithm.loss.name") == "conf/algorithm/loss/ppo_clip.yaml (algorithm/loss=ppo_clip)"
    assert origins.of("algorithm.paper") == "conf/algorithm/dapo.yaml (algorithm=dapo)"
    # experiment=smoke sets it after algorithm=dapo did: the last file wins
    assert origins.of("algorithm.overlong_filter") == "conf/experiment/smoke.yaml (experiment=smoke)"
    assert origins.of("trainer.steps") == "conf/experiment/smoke.yaml (experiment=smoke)"
    assert origins.of("eval.benchmarks.gsm8k.hub_id") == "conf/benchmark/gsm8k.yaml (benchmark=gsm8k)"
    assert origins.of("algorithm.kl.placement") == "conf/config.yaml (the primary config)"
    assert origins.of("trainer.lr") == "the command-line override 'trainer.lr=1'"
    assert origins.of("no.such.key") == ""


def test_cross_field_refusals_say_where_each_named_key_was_set(make_cfg):
    cfg = make_cfg("experiment=smoke", "rollout.n=1")
    origins = ValueOrigins(("experiment=smoke", "rollout.n=1"), tuple(composed_files({"experiment": "smoke"})))
    message = "batch of trainer.prompts_per_step * rollout.n cannot be split; see rlbench/validation.py"
    assert with_origins(message, cfg, origins) == (
        f"{message} [trainer.prompts_per_step set by conf/experiment/smoke.yaml (experiment=smoke); "
        "rollout.n set by the command-line override 'rollout.n=1']"
    )
    assert with_origins("x (set by y)", cfg, origins) == "x (set by y)"  # the schema walk already said
    assert with_origins("no keys here", cfg, origins) == "no keys here"


@pytest.mark.parametrize("override,key", [
    ("++trainer.lr=1", "trainer.lr"), ("+a.b=1", "a.b"), ("~algorithm.critic", "algorithm.critic"),
    ("algorithm=dapo", None), ("algorithm/loss=gspo", None), ("paper=dapo", None),
])
def test_override_keys(override, key):
    assert override_key(override) == key


@pytest.mark.parametrize("overrides,fragment", [
    (["trainer.lr=-1"], "trainer.lr must be > 0, got -1"),
    (["trainer.lr=abc"], "trainer.lr must be a finite number, got 'abc'"),
    (["rollout.n=0"], "rollout.n must be >= 1, got 0"),
    (["rollout.top_p=1.5"], "rollout.top_p must be > 0 and <= 1, got 1.5"),
    (["rollout.prefix_cache_mb=-1"], "rollout.prefix_cache_mb must be >= 0, got -1"),
    (["trainer.steps=1.5"], "trainer.steps must be an integer, got 1.5"),
    (["trainer.save_model=yes"], "trainer.save_model must be true or false, got 'yes'"),
    (["algorithm.loss.clip_high=-0.1"], "algorithm.loss.clip_high must be >= 0, got -0.1"),
    (["algorithm.loss.clip_low=abc"], "algorithm.loss.clip_low must be a finite number, got 'abc'"),
    (["algorithm.advantage.scale_by_std=1"], "algorithm.advantage.scale_by_std must be true or false, got 1"),
    (["algorithm.kl.placement=rewad"], "algorithm.kl.placement='rewad' is unknown; did you mean 'reward'? choose one of: loss, reward"),
    (["algorithm=dart", "+algorithm.sampling_correction.rejected_tokens=dorp"],
     "algorithm.sampling_correction.rejected_tokens='dorp' is unknown; did you mean 'drop'? choose one of: zero_weight, drop"),
    (["algorithm=dart", "+algorithm.sampling_correction.level=sequense"],
     "algorithm.sampling_correction.level='sequense' is unknown; did you mean 'sequence'? choose one of: token, sequence"),
    (["algorithm.update.schedule=natural"], "choose one of: standard, sfpo, trpo"),
    (["mode=evaluate"], "mode='evaluate' is unknown; did you mean 'eval'? choose one of: train, eval"),
    (["algorithm.kl.estimator=k4"], "algorithm.kl.estimator=k4: no KL estimator of that name"),
    (["algorithm/loss=gspo", "+algorithm.loss.clip_hihg=1"], "policy loss 'gspo' has no 'clip_hihg'; did you mean 'clip_high'?"),
    (["algorithm.loss.name=ppo_clp"], "did you mean 'ppo_clip'?"),
    (["algorithm=dapo", "++algorithm.reward_shaping.0.cache_fractio=0.1"],
     "unknown key 'algorithm.reward_shaping.0.cache_fractio': reward shaping 'dapo_overlong' has no 'cache_fractio'"),
    (["algorithm.reward_shaping=[{name: dapo_overlong, cache_fraction: abc}]"], "cache_fraction must be a finite number"),
    (["algorithm.kl.adaptive={target: 6, horizn: 10000}"], "did you mean 'horizon'?"),
    (["algorithm.entropy_adaptive={target: 0.2, detla: 0.1}"], "did you mean 'delta'?"),
])
def test_bad_values_are_refused_naming_the_key_and_what_is_allowed(make_cfg, overrides, fragment):
    assert fragment in refused(make_cfg("experiment=smoke", *overrides))


def test_a_settings_block_for_a_schedule_that_is_not_selected_is_refused(make_cfg):
    message = refused(make_cfg("experiment=smoke", "+algorithm.update.trpo.max_kl=0.1"))
    assert message.startswith("algorithm.update.trpo holds the settings of algorithm.update.schedule=trpo, "
                              "but algorithm.update.schedule is standard; set algorithm.update.schedule=trpo")
    check_against_schema(make_cfg("algorithm=trpo", "algorithm.update.trpo.max_kl=0.1"), registered(), NO_ORIGINS)


def test_a_settings_block_for_a_rollout_strategy_that_is_not_selected_is_refused(make_cfg):
    message = refused(make_cfg("experiment=smoke", "+rollout.dynamic_sampling.max_rounds=3"))
    assert "rollout.dynamic_sampling holds the settings of rollout.strategy=dynamic_sampling" in message
    assert "but rollout.strategy is iid" in message
    check_against_schema(make_cfg("rollout=dynamic_sampling", "rollout.dynamic_sampling.max_rounds=3"), registered(), NO_ORIGINS)


def test_a_new_rollout_strategy_brings_its_block_without_a_schema_edit(make_cfg, monkeypatch):
    from rlbench.rollout import STRATEGIES

    monkeypatch.setitem(STRATEGIES, "tree", object)
    check_against_schema(make_cfg("experiment=smoke", "rollout.strategy=tree", "+rollout.tree={depth: 2}"), registered(), NO_ORIGINS)
    message = refused(make_cfg("experiment=smoke", "+rollout.tree={depth: 2}"))
    assert "rollout.tree holds the settings of rollout.strategy=tree, but rollout.strategy is iid" in message
    monkeypatch.delitem(STRATEGIES, "tree")
    assert "unknown key 'rollout.tree'" in refused(make_cfg("experiment=smoke", "+rollout.tree={depth: 2}"))


def test_a_key_that_moved_says_where_to(make_cfg):
    message = refused(make_cfg("experiment=smoke", "+algorithm.dynamic_sampling.enabled=true"))
    assert message.startswith("unknown key 'algorithm.dynamic_sampling': it moved to the rollout strategy")
    # trainer.strategy became trainer.parallelism ("strategy" is the rollout strategy alone): the override
    # names the new key, from the command line and from a config file alike
    from rlbench.config.walk import unknown_override_message

    moved = unknown_override_message(make_cfg("experiment=smoke"), "trainer.strategy", "trainer.strategy=ddp")
    assert moved.startswith("unknown key 'trainer.strategy': it moved to trainer.parallelism")
    assert "it moved to trainer.parallelism" in refused(make_cfg("experiment=smoke", "+trainer.strategy=ddp"))


def test_validate_config_runs_the_schema_walk_first(make_cfg):
    with pytest.raises(ConfigError, match="did you mean 'lr'"):
        validate_config(make_cfg("experiment=smoke", "++trainer.lrr=1"))


def test_sampling_correction_level_and_normalize_pass_the_config_check_and_refuse_mask(make_cfg):
    """From the command line: truncate at level sequence with normalisation is accepted; level
    sequence with mode mask is refused before anything loads (verl has it only for truncated IS)."""
    validate_config(make_cfg("experiment=smoke", "+algorithm.sampling_correction={cap: 2.0, level: sequence, normalize: true}"))
    with pytest.raises(ConfigError, match="level=sequence needs mode truncate"):
        validate_config(make_cfg("experiment=smoke", "+algorithm.sampling_correction={mode: mask, level: sequence}"))
    assert "normalize must be true or false" in refused(
        make_cfg("experiment=smoke", "+algorithm.sampling_correction={normalize: maybe}"))


def test_every_schema_field_has_a_help_string():
    def fields(schema):
        for spec in dataclasses.fields(schema):
            yield schema, spec
            if "node" in spec.metadata:
                yield from fields(spec.metadata["node"])

    missing = [f"{schema.__name__}.{spec.name}" for schema, spec in fields(RunConfig) if not spec.metadata.get("help")]
    assert not missing


@pytest.mark.parametrize("schema,runtime", [
    (SFPOConfig, SFPOSettings), (TRPOConfig, TRPOSettings), (CriticConfig, CriticSettings),
    (AdaptiveEntropyConfig, AdaptiveEntropy), (SamplingCorrectionConfig, SamplingCorrection),
])
def test_schema_blocks_match_the_settings_the_code_reads(schema, runtime):
    """Same keys and the same defaults as the dataclass the algorithm builds from the block."""
    def defaults(cls):
        return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}

    assert [f.name for f in dataclasses.fields(schema)] == [f.name for f in dataclasses.fields(runtime)]
    runtime_defaults = defaults(runtime)
    assert {k: v for k, v in defaults(schema).items() if k in runtime_defaults} == runtime_defaults


def test_the_algorithm_defaults_in_config_yaml_equal_the_schema_defaults():
    """conf/config.yaml gives the knobs presets rarely set a value, so each is a plain override;
    those values are the schema's defaults."""
    yaml_defaults = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "config.yaml").algorithm)

    def schema_default(schema, path):
        spec = {f.name: f for f in dataclasses.fields(schema)}[path[0]]
        if len(path) > 1:
            return schema_default(spec.metadata["node"], path[1:])
        if spec.default_factory is not dataclasses.MISSING:
            return spec.default_factory()
        return spec.default

    def leaves(node, path=()):
        for key, value in node.items():
            if isinstance(value, dict) and value:
                yield from leaves(value, (*path, key))
            else:
                yield (*path, key), value

    for path, value in leaves(yaml_defaults):
        assert schema_default(AlgorithmConfig, path) == value, ".".join(path)


@pytest.mark.parametrize("node,schema", [("trainer", TrainerConfig), ("rollout", RolloutConfig)])
def test_the_base_trainer_and_rollout_yaml_values_equal_the_schema_defaults(make_cfg, node, schema):
    """conf/trainer/default.yaml and conf/rollout/iid.yaml write every key out with its comment, and the
    schema holds the default a run takes when a key is left out: the two agree, key by key."""
    typed = typed_config(make_cfg())
    composed = getattr(make_cfg(), node)
    drift = [
        f"{node}.{spec.name}: yaml {getattr(getattr(typed, node), spec.name)!r}, schema {value!r}"
        for spec in dataclasses.fields(schema)
        if spec.name in composed and not spec.metadata.get("derived")
        for value in [spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default]
        if getattr(getattr(typed, node), spec.name) != (spec.metadata["node"]() if "node" in spec.metadata else value)
    ]
    assert not drift, "\n".join(drift)


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_each_strategy_yaml_block_equals_the_defaults_its_options_declare(make_cfg, strategy):
    """conf/rollout/<strategy>.yaml shows the strategy's block with every key; the strategy reads the same
    options from it as from no block at all (its defaults live in the code, the YAML repeats them). Keys the
    YAML takes from elsewhere (``${trainer.steps}``) are not defaults; a strategy whose option has no
    default (a required key) refuses the empty block."""
    cfg = make_cfg(f"rollout={strategy}")
    rollout, cls = typed_config(cfg).rollout, STRATEGIES[strategy]
    block = cfg.rollout.get(strategy) or {}
    derived = {key for key in block if OmegaConf.is_interpolation(block, key)}
    with_block = dataclasses.replace(rollout, settings={strategy: {k: v for k, v in rollout.settings.get(strategy, {}).items() if k not in derived}})
    try:
        defaults = cls.config_options(dataclasses.replace(rollout, settings={}))
    except ConfigError:
        return
    assert cls.config_options(with_block) == defaults


def test_a_drifted_strategy_yaml_value_is_caught(make_cfg):
    rollout = typed_config(make_cfg("rollout=lookahead", "rollout.lookahead.abs_threshold=0.2")).rollout
    cls = STRATEGIES["lookahead"]
    assert cls.config_options(rollout) != cls.config_options(dataclasses.replace(rollout, settings={}))


def test_nearest_spelling():
    assert nearest("lrr", ["lr", "steps"]) == "lr"
    assert nearest("zzz", ["lr", "steps"]) is None



def test_a_plain_override_of_a_missing_key_names_the_first_missing_segment_and_its_nearest_spelling():
    from omegaconf import OmegaConf

    from rlbench.config.walk import unknown_override_message

    cfg = OmegaConf.create({"trainer": {"lr": 1.0, "steps": 2}, "algorithm": {"kl": {"placement": "loss", "adaptive": None}}})
    message = unknown_override_message(cfg, "trainer.lrr", "trainer.lrr=1")
    assert message.startswith("unknown key 'trainer.lrr': trainer has no 'lrr'; did you mean 'lr'?")
    assert message.endswith("(set by the command-line override 'trainer.lrr=1')")
    assert "did you mean 'trainer'?" in unknown_override_message(cfg, "trainr.lr", "trainr.lr=1")
    assert "algorithm.kl has no 'placment'; did you mean 'placement'?" in unknown_override_message(
        cfg, "algorithm.kl.placment", "algorithm.kl.placment=reward")
    assert unknown_override_message(cfg, "trainer.lr", "trainer.lr=2") is None  # an existing key
    assert unknown_override_message(cfg, "algorithm.kl.adaptive.target", "x") is None  # below a null node: Hydra's call
    required = OmegaConf.create({"model": {"source": "path", "path": "???"}})  # model=checkpoint
    assert unknown_override_message(required, "model.path", "model.path=results/latest/policy") is None
    assert "model has no 'pth'" in unknown_override_message(required, "model.pth", "model.pth=x")


def test_the_run_reads_the_config_typed_once_with_the_schemas_defaults(make_cfg):
    """rlbench/config/typed.py: nodes become their dataclasses, a key the YAML leaves out takes the
    schema's default, open values stay plain containers and a choice's settings block lands in
    ``settings``."""
    from omegaconf import open_dict

    from rlbench.config.schema import RolloutConfig, RunConfig, TrainerConfig
    from rlbench.config.typed import typed_config

    cfg = make_cfg("experiment=smoke", "rollout=tree", "rollout.temperature=1")
    with open_dict(cfg):
        del cfg.rollout["batch_size"]
    config = typed_config(cfg)
    assert isinstance(config, RunConfig) and isinstance(config.trainer, TrainerConfig)
    assert isinstance(config.rollout, RolloutConfig) and config.rollout.strategy == "tree"
    assert config.rollout.batch_size == RolloutConfig.__dataclass_fields__["batch_size"].default
    assert config.rollout.temperature == 1.0 and isinstance(config.rollout.temperature, float)
    assert config.rollout.settings == {"tree": dict(cfg.rollout.tree)}
    assert isinstance(config.algorithm.advantage, dict) and config.algorithm.advantage["name"] == cfg.algorithm.advantage.name


@pytest.mark.parametrize("block,message", [
    ({"abs_threshold": "high"}, r"rollout.lookahead.abs_threshold='high' is not a finite number"),
    ({"checkpoints": [2.5]}, r"rollout.lookahead.checkpoints=\(2.5,\) is not a tuple\[int, ...\]"),
    ({"depth": 2}, r"rollout.lookahead has no key\(s\) \['depth'\]; it takes \[[^]]*\]$"),
    ({"abs_treshold": 0.2}, r"has no key\(s\) \['abs_treshold'\]; .*\(did you mean 'abs_treshold' -> 'abs_threshold'\?\)"),
])
def test_a_strategy_option_of_the_wrong_type_or_name_is_refused_naming_it(block, message):
    with pytest.raises(ConfigError, match=message):
        STRATEGIES["lookahead"].config_options(rollout_config({"strategy": "lookahead", "n": 4, "lookahead": block}))


def test_strategy_options_convert_yaml_values_to_the_field_types():
    """An integer in a float field becomes a float and lists become the tuples the dataclass declares, so an
    option read from YAML equals the same option written in code."""
    options = STRATEGIES["lookahead"].config_options(rollout_config(
        {"strategy": "lookahead", "n": 4, "lookahead": {"abs_threshold": 0, "checkpoints": [4], "mix_schedule": [[0, 1]]}}
    ))["options"]
    assert options.abs_threshold == 0.0 and isinstance(options.abs_threshold, float)
    assert options.checkpoints == (4,) and options.mix_schedule == ((0, 1.0),)
    assert isinstance(options.mix_schedule[0][1], float)
