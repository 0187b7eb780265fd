"""Direct Advantage PO's critic trained apart (``algorithm.step_critic``; arXiv:2412.18279, section 3;
rlbench/algorithm/step_critic.py, rlbench/training/step_critic.py): the critic values a state from its own
prefix, is fitted onto Monte-Carlo values, and gives every step of the offline responses its value, whose
differences are the actor's step advantages."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import TOY_OFFLINE, compose_config  # noqa: E402
from test_preference_offline import steps as metrics  # noqa: E402

from rlbench.algorithm.advantages.vine import vine_advantage  # noqa: E402
from rlbench.algorithm.step_critic import fit_step_critic, state_positions  # noqa: E402
from rlbench.algorithm.value_model import ValuedSequence, ValueModel, predict_values  # noqa: E402
from rlbench.config.schema import StepCriticConfig  # noqa: E402
from rlbench.errors import ConfigError  # noqa: E402
from rlbench.rollout.engines.base import Completion  # noqa: E402
from rlbench.rollout.strategies.vine import VineOptions  # noqa: E402
from rlbench.training.step_critic import StepCritic  # noqa: E402
from rlbench.validation import validate_config  # noqa: E402

PAD = 0


def tiny_critic(seed: int = 0, head: bool = True) -> ValueModel:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, max_position_embeddings=64)
    model = ValueModel(LlamaForCausalLM(config))
    if head:  # a head that reads the hidden state (the fitted critic's starts at zero)
        torch.nn.init.normal_(model.head.linear.weight)
    return model


def test_a_states_value_is_read_at_its_last_token():
    assert state_positions(3, [0, 2, 5]) == (2, 4, 7)
    with pytest.raises(ValueError):
        state_positions(0, [0])


def test_a_state_is_valued_from_its_own_prefix_whatever_follows():
    model = tiny_critic()
    prompt, response = (5, 6, 7), (8, 9, 10, 11, 12)
    starts = [0, 2, 4]
    whole = ValuedSequence(prompt + response, state_positions(len(prompt), starts))
    alone = [ValuedSequence(prompt + response[:s], (len(prompt) + s - 1,)) for s in starts]
    values = predict_values(model, [whole], PAD, batch_size=1)[0]
    separately = [v[0] for v in predict_values(model, alone, PAD, batch_size=8)]  # padded beside each other
    assert values == pytest.approx(separately, abs=1e-5)
    assert len({round(v, 4) for v in values}) == 3  # three states, three values


def test_the_fit_regresses_the_critic_onto_the_monte_carlo_values():
    sequences = [ValuedSequence((1 + i, 2 + i, 3 + i, 4 + i), (1, 3), (0.1 * i, 1.0 - 0.1 * i)) for i in range(6)]

    def fit(seed):
        model = tiny_critic(head=False)
        errors = fit_step_critic(model, sequences, PAD, epochs=60, lr=0.01, batch_size=4,
                                 generator=torch.Generator().manual_seed(seed))
        return model, errors

    model, errors = fit(0)
    assert errors[-1] < 0.05 * errors[0]
    predicted = predict_values(model, sequences, PAD, batch_size=4)
    for sequence, values in zip(sequences, predicted):
        assert values == pytest.approx(list(sequence.targets), abs=0.08)
    assert fit(0)[1] == errors  # one seed, one fit
    with pytest.raises(ValueError, match="Monte-Carlo value"):
        fit_step_critic(model, [ValuedSequence((1, 2), (0, 1), (0.5,))], PAD, 1, 0.01, 1, torch.Generator())


def completion(prompt, response):
    return Completion(request_index=0, prompt_ids=tuple(prompt), response_ids=list(response), logprobs=[0.0] * len(response),
                      finished=True)


def test_annotate_gives_each_step_the_critics_value_and_the_vine_advantage_their_differences():
    settings = StepCriticConfig(boundary="tokens", step_tokens=2)
    options = VineOptions(k=1, boundary="tokens", step_tokens=2)
    tokenizer = SimpleNamespace(pad_token_id=PAD, eos_token_id=PAD)
    critic = StepCritic(settings=settings, options=options, sampler=SimpleNamespace(tokenizer=tokenizer), params=None,
                        model=tiny_critic(), identity={}, path=Path("unused"), seed=0, fitted=True)
    rows = [completion((3, 4), (5, 6, 7, 8, 9)), completion((3, 4, 2), (10, 11))]
    graded = SimpleNamespace(groups=[[rows[0]], [rows[1]]])
    critic.annotate(graded)
    expected = predict_values(critic.model, [ValuedSequence((3, 4, 5, 6, 7, 8, 9), (1, 3, 5)),
                                                   ValuedSequence((3, 4, 2, 10, 11), (2,))], PAD, 2)
    assert rows[0].extras["step_index"] == [0, 0, 1, 1, 2]
    assert rows[0].extras["step_values"] == pytest.approx([expected[0][0]] * 2 + [expected[0][1]] * 2 + [expected[0][2]])
    assert rows[1].extras["step_values"] == pytest.approx([expected[1][0]] * 2)
    # the actor's advantage: V_phi(s_{k+1}) - V_phi(s_k), the last step R - V_phi(s_{L-1})
    reward = 1.0
    step_values = torch.tensor([rows[0].extras["step_values"]], dtype=torch.float64)
    advantages = vine_advantage(torch.tensor([reward]), torch.ones(1, 5), torch.tensor([rows[0].extras["step_index"]]),
                                step_values)
    v = expected[0]
    assert advantages[0].tolist() == pytest.approx([v[1] - v[0]] * 2 + [v[2] - v[1]] * 2 + [reward - v[2]], abs=1e-6)


@pytest.mark.parametrize("overrides, message", [
    (["rollout=vine", "algorithm.step_critic={k: 2}"], "fitted on a fixed data set before the actor trains"),
    (["rollout=offline", "algorithm.step_critic={k: 0}"], "algorithm.step_critic.k must be >= 1"),
    (["rollout=offline", "algorithm.step_critic={boundary: sentence}"], "algorithm.step_critic.boundary must be one of"),
    (["rollout=offline", "algorithm.step_critic={k: 2}", "model/lora=default"], "model.lora"),
])
def test_a_critic_without_its_data_set_or_reference_is_refused_before_loading(make_cfg, overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(make_cfg("experiment=smoke", "algorithm=direct_advantage_po", *overrides))


def test_an_offline_actor_without_a_critic_is_told_where_step_values_come_from(make_cfg):
    with pytest.raises(ConfigError, match="rollout=offline with algorithm.step_critic"):
        validate_config(make_cfg("experiment=smoke", "algorithm=direct_advantage_po", "rollout=offline"))
    validate_config(make_cfg("experiment=smoke", "algorithm=direct_advantage_po", "rollout=offline", "algorithm.step_critic={k: 2}"))


# ------------------------------------------------------------------------------ through the runner



def critic(**changes) -> str:
    settings = {"k": 2, "boundary": "tokens", "step_tokens": 2, "epochs": 3, "lr": 0.001, "batch_size": 4, **changes}
    return "algorithm.step_critic={" + ", ".join(f"{k}: {v}" for k, v in settings.items()) + "}"


def offline_overrides(traces, *extra, **critic_changes):
    return [*TOY_OFFLINE, "algorithm=direct_advantage_po", "rollout=offline", "guidance=jsonl", f"guidance.path={traces}",
            "guidance.keep_incorrect=true", "rollout.n=4", "trainer.prompts_per_step=2", "dataset.arith.train_size=6",
            "eval.before_training=false", critic(**critic_changes), *extra]


@pytest.mark.slow
def test_the_critic_is_fitted_once_before_the_actor_and_read_back_by_a_run_of_its_identity(tmp_path, toy_traces):
    from rlbench.runner import run

    run(compose_config(offline_overrides(toy_traces, "trainer.steps=3"), tmp_path / "first"))
    saved = torch.load(tmp_path / "first" / "step_critic.pt", weights_only=False)
    fit = saved["metrics"]
    assert fit["responses"] == 24  # the whole data set, not one step's batch
    assert fit["states"] >= 24 and fit["continuations"] == 2 * fit["states"]  # K = 2 pi_ref continuations per state
    assert fit["error_after"] < fit["error_before"]
    rows = metrics(tmp_path / "first")
    assert all(row["generated_responses"] == 0 for row in rows)  # the actor trains offline: the policy samples nothing
    assert all("step_critic_value_mean" in row and "step_residual_abs" in row for row in rows)
    # a second run of the same identity reads the critic (the file is not rewritten) and trains the same steps
    stamp = (tmp_path / "first" / "step_critic.pt").stat().st_mtime_ns
    saved_path = tmp_path / "first" / "step_critic.pt"
    run(compose_config(offline_overrides(toy_traces, "trainer.steps=3", path=saved_path), tmp_path / "second"))
    assert (tmp_path / "first" / "step_critic.pt").stat().st_mtime_ns == stamp
    assert not (tmp_path / "second" / "step_critic.pt").exists()
    drop = ("step_s", "update_s", "generate_s", "tokens_per_s", "peak_memory_mb", "time")
    assert [{k: v for k, v in r.items() if k not in drop} for r in metrics(tmp_path / "second")] == \
        [{k: v for k, v in r.items() if k not in drop} for r in rows]
    # another critic setting is another identity: fitted again, not read
    run(compose_config(offline_overrides(toy_traces, "trainer.steps=1", epochs=1, path=saved_path), tmp_path / "third"))
    assert torch.load(tmp_path / "first" / "step_critic.pt", weights_only=False)["identity"]["settings"]["epochs"] == 1


@pytest.mark.slow
def test_resume_continues_with_the_critic_it_started_with(tmp_path, toy_traces):
    from test_resume import RESULT_FILES, metrics_without_timing, run_and_resume_from_step_2

    overrides = offline_overrides(toy_traces, "trainer.steps=4", "trainer.checkpoint_every=2", "eval.every=2",
                                  "trainer.save_model=false")
    reference, resumed = run_and_resume_from_step_2(overrides, tmp_path)
    # the resumed run reads the critic back (it fits nothing: less peak memory) and computes log pi_ref of the
    # offline responses again (rollout.offline.reference_cache=null keeps them for one process: the cache's counts)
    run_bound = ("peak_memory_mb", "reference_cache_hits", "reference_cache_misses")

    def trained(run_dir):
        return [{k: v for k, v in row.items() if k not in run_bound} for row in metrics_without_timing(run_dir)]

    assert trained(resumed) == trained(reference)
    for name in RESULT_FILES:
        assert (resumed / name).read_bytes() == (reference / name).read_bytes(), name


def test_the_memory_check_counts_the_fitted_models_beside_the_reference(make_cfg, monkeypatch):
    import rlbench.validation as validation

    counted = []
    monkeypatch.setattr(validation, "check_fits_here", lambda *a, frozen_models, **k: counted.append(frozen_models))
    validate_config(make_cfg("experiment=smoke", "algorithm=direct_advantage_po", "rollout=offline", "algorithm.step_critic={k: 2}"))
    validate_config(make_cfg("experiment=smoke", "algorithm=dr_preference", "rollout=offline", "algorithm.preference_model={epochs: 1}"))
    validate_config(make_cfg("experiment=smoke", "algorithm=dr_preference", "rollout=offline"))
    assert counted == [2, 2, 1]  # pi_ref and the fitted model; pi_ref alone
