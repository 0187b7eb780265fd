"""SALSA (arXiv:2411.01798): the KL reference as a weight soup of two fine-tuned checkpoints (their exact
average, fixed for the run), or of policy snapshots. The soup is the parameter average, with one ingredient it is the plain reference, it is saved and restored as state,
bad options are refused before the model loads, and the preset runs from the command line."""

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import compose_config, smoke_cli_steps  # noqa: E402

from rlbench.validation import validate_config  # noqa: E402
from rlbench.errors import ConfigError  # noqa: E402
from rlbench.model.lora import reference_model  # noqa: E402
from rlbench.training.reference_soup import ReferenceSoup, add_to_soup, soup_average  # noqa: E402


def model_with(value_a: float, value_b: float) -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) * value_a + value_b * i)
    return model


def test_soup_is_the_parameter_average():
    models = [model_with(1.0, 0.0), model_with(-2.0, 3.0), model_with(0.5, -1.0)]
    soup = soup_average(m.state_dict() for m in models)
    for name, tensor in models[0].state_dict().items():
        expected = sum(m.state_dict()[name] for m in models) / 3
        assert torch.allclose(soup[name], expected, atol=1e-6)
    # the running average the trainer keeps gives the same soup
    running = reference_model(models[0])
    for k, model in enumerate(models[1:], start=1):
        add_to_soup(running, model, k)
    for name, param in running.named_parameters():
        assert torch.allclose(param, soup[name], atol=1e-6)
    with pytest.raises(ValueError, match="shape"):
        soup_average([models[0].state_dict(), torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)).state_dict()])


def test_a_soup_of_one_model_is_the_plain_reference():
    policy = model_with(1.0, 0.5)
    plain = reference_model(policy)
    soup = ReferenceSoup(reference_model(policy), every=1, models=1)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(1.0)  # the policy trains
    for updates in range(1, 4):
        assert soup.after_update(policy, updates) == {"soup_models": 1.0}
    for (name, a), (_, b) in zip(plain.named_parameters(), soup.reference.named_parameters()):
        assert torch.equal(a, b), name


def test_snapshots_are_taken_every_n_updates_until_the_soup_is_full_and_restored_from_state():
    initial = model_with(1.0, 0.0)
    policy = copy.deepcopy(initial)
    soup = ReferenceSoup(reference_model(initial), every=2, models=3)
    snapshots = [copy.deepcopy(initial)]
    for updates in range(1, 8):
        with torch.no_grad():
            for p in policy.parameters():
                p.mul_(1.5).add_(0.25)
        soup.after_update(policy, updates)
        if updates in (2, 4):
            snapshots.append(copy.deepcopy(policy))
        if updates == 3:
            saved = soup.state_dict()
    assert soup.ingredients == 3
    expected = soup_average(m.state_dict() for m in snapshots)
    for name, param in soup.reference.named_parameters():
        assert torch.allclose(param, expected[name], atol=1e-5)
    # restore the state of update 3 into a fresh soup, replay updates 4..7: the same reference
    restored = ReferenceSoup(reference_model(initial), every=2, models=3)
    restored.load_state_dict(saved)
    assert restored.ingredients == 2
    replay = copy.deepcopy(snapshots[2])
    add_to_soup(restored.reference, replay, restored.ingredients)
    for (_, a), (_, b) in zip(restored.reference.named_parameters(), soup.reference.named_parameters()):
        assert torch.allclose(a, b, atol=1e-6)


def test_bad_soup_options_are_refused_before_the_model_loads(tmp_path):
    with pytest.raises(ConfigError, match="kl.coef > 0"):
        validate_config(compose_config(["algorithm=salsa", "experiment=smoke", "algorithm.kl.coef=0"], tmp_path / "a"))
    with pytest.raises(ConfigError, match="LoRA"):
        validate_config(compose_config(["algorithm=salsa", "experiment=smoke", "model/lora=default"], tmp_path / "b"))
    with pytest.raises(ConfigError, match="every"):
        validate_config(compose_config(["algorithm=salsa", "experiment=smoke", "algorithm.reference_soup.every=0"], tmp_path / "c"))
    with pytest.raises(ConfigError, match="both set the KL reference"):  # ReMix's reincarnation replaces it too
        validate_config(compose_config(["algorithm=salsa", "experiment=smoke", "+algorithm.reincarnate_at=2"], tmp_path / "e"))
    # any algorithm with a KL term takes the soup
    validate_config(compose_config(["algorithm=grpo", "experiment=smoke", "algorithm.kl.coef=0.1",
                                    "+algorithm.reference_soup={models: 3, every: 2}"], tmp_path / "d"))


@pytest.mark.slow
def test_salsa_runs_from_the_command_line_and_fills_its_soup(tmp_path):
    steps = smoke_cli_steps(tmp_path / "run", "algorithm=salsa", "trainer.steps=3", "algorithm.reference_soup.every=2")
    assert [s["soup_models"] for s in steps] == [1.0, 2.0, 2.0]
    assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the first step's policy is the reference


def tiny_llama(seed: int, hidden: int = 8):
    """A small Llama of the transformers library, its weights a function of ``seed``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=hidden, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # the norms start at 1 in every model: move them too
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return model


def test_the_reference_is_the_average_of_two_fine_tuned_checkpoints(tmp_path):
    """SALSA's soup (arXiv:2411.01798, section 3): the KL reference is the parameter average of the two
    checkpoints given, not the initial policy and its snapshot; it stays fixed through the run."""
    from rlbench.config.schema import ReferenceSoupConfig

    a, b, policy = tiny_llama(1), tiny_llama(2), tiny_llama(0)
    a.save_pretrained(tmp_path / "a")
    b.save_pretrained(tmp_path / "b")
    reference = reference_model(policy)
    soup = ReferenceSoup.from_config(ReferenceSoupConfig(checkpoints=[str(tmp_path / "a"), str(tmp_path / "b")]), reference)
    pa, pb, pp = dict(a.named_parameters()), dict(b.named_parameters()), dict(policy.named_parameters())
    for name, param in reference.named_parameters():
        expected = ((pa[name].double() + pb[name].double()) / 2).float()
        assert torch.equal(param, expected), name
        assert not torch.equal(param, pp[name])  # not the initial policy
    before = {k: v.clone() for k, v in reference.named_parameters()}
    assert soup.after_update(policy, 8) == {"soup_models": 2.0}  # full from the start: no snapshot is added
    assert all(torch.equal(before[k], v) for k, v in reference.named_parameters())
    restored = ReferenceSoup.from_config(ReferenceSoupConfig(models=2, every=8), reference_model(policy))
    restored.load_state_dict(soup.state_dict())  # checkpoints of the run: the soup's weights come back
    assert all(torch.equal(before[k], v) for k, v in restored.reference.named_parameters())


def test_a_checkpoint_of_another_architecture_or_a_single_one_is_refused(tmp_path):
    from rlbench.config.schema import ReferenceSoupConfig

    tiny_llama(1).save_pretrained(tmp_path / "a")
    tiny_llama(2, hidden=16).save_pretrained(tmp_path / "wide")
    with pytest.raises(ConfigError, match=r"wide is not a checkpoint of the policy's architecture"):
        ReferenceSoup.from_config(ReferenceSoupConfig(checkpoints=[str(tmp_path / "a"), str(tmp_path / "wide")]),
                                  reference_model(tiny_llama(0)))
    base = ["algorithm=salsa", "experiment=smoke"]
    with pytest.raises(ConfigError, match="at least two models"):
        validate_config(compose_config([*base, f"algorithm.reference_soup.checkpoints=[{tmp_path / 'a'}]"], tmp_path / "c1"))
    with pytest.raises(ConfigError, match="missing is not a Hugging Face checkpoint folder"):
        validate_config(compose_config([*base, f"algorithm.reference_soup.checkpoints=[{tmp_path / 'a'},{tmp_path / 'missing'}]"],
                                       tmp_path / "c2"))


@pytest.mark.slow
def test_salsa_soup_of_two_checkpoints_from_the_command_line(tmp_path):
    """Two checkpoints of the smoke model (its tiny architecture at seeds 1 and 2) as SALSA's ingredients:
    the run starts with the soup as reference, so the first step's KL is already above 0 and the soup is
    full (2 ingredients) from the first step."""
    from rlbench.config.typed import typed_config
    from rlbench.model import load_policy

    paths = []
    for seed in (1, 2):
        cfg = compose_config(["experiment=smoke", f"seed={seed}"], tmp_path / f"cfg{seed}")
        model, _ = load_policy(typed_config(cfg).model, device=torch.device("cpu"), dtype=torch.float32, seed=seed,
                               cache_dir=cfg.cache_dir)
        model.save_pretrained(tmp_path / f"sft{seed}")
        paths.append(str(tmp_path / f"sft{seed}"))
    steps = smoke_cli_steps(tmp_path / "run", "algorithm=salsa", f"algorithm.reference_soup.checkpoints=[{','.join(paths)}]")
    assert [s["soup_models"] for s in steps] == [2.0, 2.0]
    assert steps[0]["kl"] > 1e-3  # the reference is not the initial policy
