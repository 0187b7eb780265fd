"""QRPO (arXiv:2507.08068): quantile rewards, the analytic partition function, the loss and its optimum
(rlbench/algorithm/losses/quantile_reward.py); the reference caches (rlbench/training/reference_cache.py)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import algorithm_from, compose_config
from test_preference import fit_bandit

from rlbench.algorithm.aggregation import group_mean
from rlbench.algorithm.losses.quantile_reward import (
    group_quantile_rewards,
    log_uniform_partition,
    qrpo_loss,
    quantile_rewards,
)
from rlbench.training.batch import whole_group_chunks


@pytest.mark.parametrize("beta", [0.05, 0.2, 1.0, 5.0])
def test_the_analytic_partition_matches_a_monte_carlo_estimate(beta):
    gen = torch.Generator().manual_seed(0)
    u = torch.rand(400_000, generator=gen, dtype=torch.float64)  # r_q under pi_ref: U[0, 1]
    weights = torch.exp(u / beta - 1 / beta)  # exp(r_q / beta), scaled by exp(-1/beta) to stay finite
    standard_error = (weights.std() / weights.mean()).item() / math.sqrt(len(u))  # of log Z's estimate
    estimate = weights.mean().log().item() + 1 / beta
    assert log_uniform_partition(beta) == pytest.approx(estimate, abs=4 * standard_error)
    assert log_uniform_partition(beta) == pytest.approx(math.log(beta * math.expm1(1 / beta)), rel=1e-12)


def test_the_partition_of_quantiles_of_reference_samples_is_the_analytic_one():
    """The whole path: continuous rewards of K reference samples, fresh pi_ref samples' quantiles among them,
    E[exp(r_q / beta)] against Z_q. The empirical CDF of K samples is within eps = sqrt(log(2/delta) / (2K)) of
    the true one with probability 1 - delta (Dvoretzky-Kiefer-Wolfowitz), which moves log Z by at most eps / beta."""
    beta, gen, k = 0.5, torch.Generator().manual_seed(1), 2000
    reference = torch.randn(1, k, generator=gen, dtype=torch.float64) * 3 + 1
    fresh = torch.randn(20_000, generator=gen, dtype=torch.float64) * 3 + 1
    quantiles = quantile_rewards(fresh, reference.expand(len(fresh), -1))
    weights = torch.exp(quantiles / beta)
    standard_error = (weights.std() / weights.mean()).item() / math.sqrt(len(fresh))
    eps = math.sqrt(math.log(2 / 1e-4) / (2 * k))
    assert abs(quantiles.mean().item() - 0.5) < eps + 4 * quantiles.std().item() / math.sqrt(len(fresh))
    assert log_uniform_partition(beta) == pytest.approx(weights.mean().log().item(), abs=eps / beta + 4 * standard_error)


def test_a_small_beta_keeps_the_partition_finite():
    assert log_uniform_partition(1e-4) == pytest.approx(math.log(1e-4) + 1e4, rel=1e-12)
    with pytest.raises(ValueError, match="beta"):
        log_uniform_partition(0.0)


def test_binary_rewards_get_mid_rank_quantiles():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])  # group 0: 2 of 4 right; group 1: none
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 1, 1])
    mid = group_quantile_rewards(rewards, groups)
    assert mid[:4].tolist() == [0.75, 0.25, 0.25, 0.75]  # right: (2 below + 2 tied / 2) / 4; wrong: (0 + 2 / 2) / 4
    assert mid[4:].tolist() == [0.5] * 6  # all tied: the middle, as the mean of U[0, 1]
    assert group_quantile_rewards(rewards, groups, ties="at_most")[:4].tolist() == [1.0, 0.5, 0.5, 1.0]  # the paper's <=
    one_right = group_quantile_rewards(torch.tensor([0.0, 0.0, 0.0, 1.0]), torch.zeros(4, dtype=torch.long))
    assert one_right.tolist() == [0.375, 0.375, 0.375, 0.875]
    assert one_right.mean().item() == pytest.approx(0.5)  # mid-rank quantiles average 1/2 under the reference samples
    with pytest.raises(ValueError, match="ties"):
        group_quantile_rewards(rewards, groups, ties="min")


def test_the_loss_matches_its_closed_form_value_and_gradient():
    beta = 0.3
    gen = torch.Generator().manual_seed(2)
    logp = (-torch.rand(5, 4, generator=gen)).requires_grad_()
    ref = -torch.rand(5, 4, generator=gen)
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]])
    rewards, groups = torch.tensor([0.2, 0.9, 0.5, 1.0, 0.0]), torch.tensor([0, 0, 0, 1, 1])
    matrix, metrics = qrpo_loss(logp, ref, mask, rewards, groups, beta=beta)
    delta = ((logp - ref) * mask).sum(-1)
    quantiles = torch.tensor([1 / 6, 5 / 6, 1 / 2, 3 / 4, 1 / 4])
    log_z = math.log(beta * (math.exp(1 / beta) - 1))
    per_response = (quantiles - beta * log_z - beta * delta) ** 2
    expected = (per_response[:3].mean() + per_response[3:].mean()) / 2
    loss = group_mean(matrix, mask, batch_groups=2)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    (grad,) = torch.autograd.grad(loss, logp)
    (want,) = torch.autograd.grad(expected, logp)
    assert torch.allclose(grad, want, atol=1e-6)
    assert metrics["quantile_reward"] == pytest.approx(quantiles.mean().item())


def test_micro_batches_of_whole_groups_add_up_to_the_full_batch_loss():
    gen = torch.Generator().manual_seed(3)
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    rewards = (torch.rand(9, generator=gen) > 0.5).float()
    logp, ref, mask = -torch.rand(9, 5, generator=gen), -torch.rand(9, 5, generator=gen), torch.ones(9, 5)
    full = group_mean(qrpo_loss(logp, ref, mask, rewards, groups, beta=0.5)[0], mask, batch_groups=3)
    parts = sum(group_mean(qrpo_loss(logp[c], ref[c], mask[c], rewards[c], groups[c], beta=0.5)[0], mask[c], batch_groups=3)
                for c in whole_group_chunks(torch.arange(9), groups, 4))
    assert parts.item() == pytest.approx(full.item(), rel=1e-6)


def test_a_tabular_policy_reaches_the_reference_tilted_by_the_quantile_reward():
    """Offline QRPO as in the paper: the group is a sample of pi_ref (arm a appears counts[a] times out of N),
    each response is trained on and is also a reference sample; distinct rewards per arm. The squared loss's
    minimiser is pi_ref exp(r_q / beta) / Z (mid-rank r_q: the midpoint rule of Z's integral, so the
    normalisation is Z_q up to O(h^2 / beta^2))."""
    beta = 1.0
    counts = torch.tensor([6, 10, 8, 12, 7, 9, 11, 5, 8, 10, 9, 6, 12, 7, 4, 4])
    arm_rewards = torch.randperm(len(counts), generator=torch.Generator().manual_seed(4)).float()
    rows = torch.repeat_interleave(torch.arange(len(counts)), counts)  # the N = 128 responses' arms
    pi_ref = counts / counts.sum()
    rewards, group = arm_rewards[rows], torch.zeros(len(rows), dtype=torch.long)
    mask, ref = torch.ones(len(rows), 1), pi_ref.log()[rows][:, None]

    def loss_of(logp_of_arms: torch.Tensor) -> torch.Tensor:
        return group_mean(qrpo_loss(logp_of_arms[rows], ref, mask, rewards, group, beta=beta)[0], mask, batch_groups=1)

    fitted = fit_bandit(loss_of, steps=2000, lr=0.05, arms=len(counts))
    quantiles = group_quantile_rewards(rewards, group)
    per_arm = torch.zeros(len(counts)).index_put_((rows,), quantiles)
    target = pi_ref * torch.exp(per_arm / beta)
    assert (target.sum() / math.exp(log_uniform_partition(beta))).item() == pytest.approx(1.0, abs=2e-3)
    assert torch.allclose(fitted, target / target.sum(), atol=2e-3)


def test_the_preset_composes_reads_whole_groups_and_loads_a_reference(tmp_path):
    cfg = compose_config(["algorithm=qrpo"], tmp_path)
    algorithm = algorithm_from(cfg.algorithm)
    assert algorithm.loss_reads_whole_groups and algorithm.needs_reference
    assert cfg.algorithm.loss.beta == 0.01
    assert cfg.algorithm.get("fidelity") is None  # faithful: its K pi_ref samples per prompt are built


# ------------------------------------------------------------------ the reference log-prob cache

from rlbench.errors import DataError
from rlbench.rollout.engines.base import Completion
from rlbench.training.batch import collate
from rlbench.training.forward import batch_outputs
from rlbench.training.reference_cache import (
    ReferenceLogProbCache,
    data_fingerprint,
    reference_log_probs,
    weights_fingerprint,
)


def tiny_reference(seed: int = 0) -> torch.nn.Module:
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config).eval()


def offline_batch(groups: list[list[tuple[tuple[int, ...], list[int]]]]):
    """A batch of (prompt ids, response ids) groups, as the offline strategy's traces become."""
    return collate([[Completion(0, prompt, list(response), [0.0] * len(response), True) for prompt, response in group]
                    for group in groups], pad_token_id=0)


GROUPS = [[((1, 2, 3), [4, 5, 6]), ((1, 2, 3), [7, 8])], [((9, 10), [11, 12, 13, 14]), ((9, 10), [15])]]


class ReferencePasses:
    """Counts the responses the cache sends through the reference model (its calls of batch_outputs)."""

    def __init__(self, monkeypatch):
        import rlbench.training.reference_cache as module

        self.rows, real = 0, module.batch_outputs

        def counted(model, batch, *args, **kwargs):
            self.rows += batch.size
            return real(model, batch, *args, **kwargs)

        monkeypatch.setattr(module, "batch_outputs", counted)


def test_a_cached_response_costs_no_reference_pass_and_keeps_its_log_probs(monkeypatch):
    reference, batch = tiny_reference(), offline_batch(GROUPS)
    counter, cache = ReferencePasses(monkeypatch), ReferenceLogProbCache(identity={"model": "m", "data": "d"})
    direct = batch_outputs(reference, batch, micro_batch_size=8, temperature=1.0).logp
    first = reference_log_probs(reference, batch, 8, 1.0, cache)
    assert counter.rows == 4 and (cache.hits, cache.misses) == (0, 4)
    assert torch.allclose(first, direct, atol=1e-5)
    again = reference_log_probs(reference, batch, 8, 1.0, cache)
    assert counter.rows == 4 and (cache.hits, cache.misses) == (4, 4)  # the second epoch: no forward pass
    assert torch.equal(again, first)
    # the same responses in another batch (other padding, another group beside them): served from the cache
    mixed = offline_batch([[((20, 21, 22, 23, 24), [25])], GROUPS[1]])
    values = reference_log_probs(reference, mixed, 8, 1.0, cache)
    assert counter.rows == 5 and (cache.hits, cache.misses) == (6, 5)
    assert torch.allclose(values, batch_outputs(reference, mixed, 8, 1.0).logp, atol=1e-5)
    assert cache.metrics() == {"reference_cache_hits": 6.0, "reference_cache_misses": 5.0}


def test_a_cache_file_of_the_same_identity_is_reused(tmp_path, monkeypatch):
    reference, batch, path = tiny_reference(), offline_batch(GROUPS), tmp_path / "ref.pt"
    identity = {"model": weights_fingerprint(reference), "data": "d", "temperature": "1.0"}
    first = ReferenceLogProbCache.open(identity, path)
    values = reference_log_probs(reference, batch, 8, 1.0, first)  # saves the new entries
    assert path.is_file()
    counter = ReferencePasses(monkeypatch)
    second = ReferenceLogProbCache.open(identity, path)
    assert torch.equal(reference_log_probs(reference, batch, 8, 1.0, second), values)
    assert counter.rows == 0 and (second.hits, second.misses, second.dropped) == (4, 0, 0)


@pytest.mark.parametrize("differs", ["model", "data"])
def test_a_cache_file_of_another_model_or_data_is_recomputed_and_counted_or_refused(tmp_path, caplog, differs):
    path = tmp_path / "ref.pt"
    reference, batch = tiny_reference(), offline_batch(GROUPS)
    identity = {"model": weights_fingerprint(reference), "data": "d", "temperature": "1.0"}
    reference_log_probs(reference, batch, 8, 1.0, ReferenceLogProbCache.open(identity, path))
    other_model = tiny_reference(seed=1)
    other = {**identity, differs: weights_fingerprint(other_model) if differs == "model" else "other data"}
    with pytest.raises(DataError, match=f"computed for another {differs} than this run's"):
        ReferenceLogProbCache.open(other, path, on_mismatch="stop")
    with caplog.at_level("WARNING"):
        cache = ReferenceLogProbCache.open(other, path)
    assert cache.dropped == 4 and not cache.entries
    assert f"computed for another {differs}: its 4 entries are dropped and recomputed" in caplog.text
    model = other_model if differs == "model" else reference
    values = reference_log_probs(model, batch, 8, 1.0, cache)
    assert cache.misses == 4 and torch.allclose(values, batch_outputs(model, batch, 8, 1.0).logp, atol=1e-5)
    assert ReferenceLogProbCache.open(other, path).entries.keys() == cache.entries.keys()  # the file now holds the new identity's


def test_the_identity_follows_the_weights_and_the_data():
    reference = tiny_reference()
    before = weights_fingerprint(reference)
    assert weights_fingerprint(tiny_reference()) == before
    with torch.no_grad():
        next(reference.parameters())[0, 0] += 1e-3
    assert weights_fingerprint(reference) != before
    data = [("a", (1, 2), 1.0), ("b", (3,), 0.0)]
    assert data_fingerprint(data) == data_fingerprint(reversed(data))  # the file's order does not matter
    assert data_fingerprint(data) != data_fingerprint([("a", (1, 2), 1.0), ("b", (3,), 1.0)])  # a reward does
    with pytest.raises(Exception, match="reference_cache_mismatch"):
        ReferenceLogProbCache.open({}, None, on_mismatch="ignore")


# ------------------------------------------------------------------ through the runner (slow tier)

from test_preference_offline import offline_run  # noqa: E402


@pytest.mark.slow
def test_offline_qrpo_computes_each_responses_reference_once_and_reuses_a_cache_file(tmp_path, toy_traces):
    """The same 2 prompts with the file's 4 responses each, 3 steps: pi_ref runs on the 8 responses at the first
    step only; a second run with the first's cache file runs it on none; a file of another model is refused
    (reference_cache_mismatch=stop) or dropped and recomputed (the default)."""
    # the file's responses only: no pi_ref samples beside them (algorithm.qrpo.reference_samples: test_qrpo_reference_rewards.py)
    same = ["dataset.arith.train_size=2", "guidance.on_bad=skip", "algorithm.qrpo.reference_samples=0"]
    rows = offline_run(tmp_path / "plain", toy_traces, "grpo", "algorithm=qrpo", "algorithm.loss.beta=0.1", "trainer.lr=2e-4", *same)
    control = offline_run(tmp_path / "control", toy_traces, "grpo", "algorithm=qrpo", "algorithm.loss.beta=0.1", "trainer.lr=2e-4", *same, "trainer.lr=1e-12")  # after the 1e-3 above: the last lr wins
    # it learns the file: the same responses' regression loss falls (0.147, 0.055, 0.016 at lr 2e-4; lr 1e-2 overshoots
    # to 9.1 by step 3); without a parameter change it does not
    assert rows[-1]["policy_loss"] < 0.9 * rows[0]["policy_loss"]
    assert control[-1]["policy_loss"] == pytest.approx(control[0]["policy_loss"], rel=1e-4)
    assert [r["reference_cache_misses"] for r in rows] == [8, 8, 8]
    assert [r["reference_cache_hits"] for r in rows] == [0, 8, 16]
    assert all(r["generated_responses"] == 0 for r in rows)
    cache = f"rollout.offline.reference_cache={tmp_path / 'ref.pt'}"
    first = offline_run(tmp_path / "first", toy_traces, "grpo", "algorithm=qrpo", "algorithm.loss.beta=0.1", "trainer.lr=2e-4", *same, cache)
    assert first[0]["reference_cache_misses"] == 8 and (tmp_path / "ref.pt").is_file()
    second = offline_run(tmp_path / "second", toy_traces, "grpo", "algorithm=qrpo", "algorithm.loss.beta=0.1", "trainer.lr=2e-4", *same, cache)
    assert [r["reference_cache_misses"] for r in second] == [0, 0, 0]
    assert [r["reference_cache_hits"] for r in second] == [8, 16, 24]
    assert second[0]["policy_loss"] == pytest.approx(first[0]["policy_loss"], rel=1e-5)
    other_model = ["model.tiny.initializer_range=0.5"]
    with pytest.raises(DataError, match="computed for another model"):
        offline_run(tmp_path / "refused", toy_traces, "grpo", "algorithm=qrpo", "algorithm.loss.beta=0.1", "trainer.lr=2e-4", *same, *other_model, cache,
                    "rollout.offline.reference_cache_mismatch=stop")
    recomputed = offline_run(tmp_path / "recomputed", toy_traces, "grpo", "algorithm=qrpo", "algorithm.loss.beta=0.1", "trainer.lr=2e-4", *same, *other_model, cache)
    assert recomputed[0]["reference_cache_misses"] == 8


def test_the_runs_cache_is_keyed_by_the_offline_file_and_off_where_the_reference_moves(tmp_path):
    from rlbench.config.typed import typed_config
    from rlbench.training.reference_cache import offline_reference_cache

    data = tmp_path / "pairs.jsonl"
    data.write_text('{"prompt": "1+3", "chosen": "4", "rejected": "5"}\n')
    reference = tiny_reference()

    def cache_of(*overrides):
        cfg = typed_config(compose_config(["algorithm=qrpo", "rollout=offline", f"rollout.offline.file={data}", *overrides],
                                          tmp_path / "compose"))
        return offline_reference_cache(cfg, reference, None, 1.0, sharded=False)

    first = cache_of()
    assert first.identity["model"] == weights_fingerprint(reference) and first.identity["data"].startswith("file sha256 ")
    data.write_text('{"prompt": "1+3", "chosen": "4", "rejected": "6"}\n')
    assert cache_of().identity["data"] != first.identity["data"]  # another file's content: another identity
    assert cache_of("+algorithm.reincarnate_at=2") is None  # the reference changes during the run
    assert offline_reference_cache(typed_config(compose_config(["algorithm=qrpo"], tmp_path / "online")), reference, None,
                                   1.0, sharded=False) is None  # online: each step's responses are new
