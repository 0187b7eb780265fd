"""One run, as in the papers' pseudo-code:

    for step in 1..S:
        prompts   <- next batch of training problems (seeded order)
        rollouts  <- sample n responses per prompt from pi_theta
        rewards   <- grade each response against the reference answer
        A         <- advantage estimator(rewards, groups)
        theta     <- optimizer step(s) on the algorithm's loss
    evaluate pi_theta before and after; write result files and log to wandb.
"""

from __future__ import annotations

import copy
import logging
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

import rlbench
from rlbench.advantage_inputs import AdvantageInputSources
from rlbench.algorithm import Algorithm
from rlbench.config import resolve_device, validate_config
from rlbench.dataset import load_problems
from rlbench.dataset.base import Problem
from rlbench.eval.evaluate import Benchmark, EvalResult, evaluate
from rlbench.group_sampling import DynamicSampling, mask_truncated, sample_groups
from rlbench.logger import RunLogger
from rlbench.model import load_policy
from rlbench.errors import ConfigError
from rlbench.reward import MathReward, grade_completions
from rlbench.reward.toy import EvenTokenReward
from rlbench.rollout import make_engine
from rlbench.rollout.base import RolloutEngine, SamplingParams
from rlbench.algorithm.critic import value_targets
from rlbench.trainer import batch_logprobs, batch_outputs, collate
from rlbench.update import UpdateState, make_update_state, update_policy
from rlbench.utils import Progress, make_generator, seed_everything

log = logging.getLogger(__name__)

# Independent random streams derived from the run seed.
STREAM_DATA_ORDER, STREAM_ROLLOUT, STREAM_EVAL, STREAM_MINIBATCH = 1, 2, 3, 4


class PromptSampler:
    """Shuffled passes over the training problems; the order is a function of the seed alone."""

    def __init__(self, problems: list[Problem], seed: int):
        self.problems = problems
        self.rng = np.random.default_rng([seed, STREAM_DATA_ORDER])
        self.order: list[int] = []

    def next(self, count: int) -> list[Problem]:
        batch = []
        while len(batch) < count:
            if not self.order:
                self.order = self.rng.permutation(len(self.problems)).tolist()
            batch.append(self.problems[self.order.pop()])
        return batch


def make_grader(reward_cfg: Any, data_spec: Any, sandbox_cfg: Any = None) -> Any:
    """The grader of one dataset or benchmark.

    ``reward.name``: ``even_tokens`` (toy) grades everything with the toy reward. Otherwise the
    spec's ``answer_type`` decides: ``code`` runs the tests in the sandbox (reward=code sets its
    mode and values; on a math run a code benchmark is graded all-pass), ``math`` checks the answer
    (reward=math sets the values; on a code run a math benchmark gets the default math grader).
    """
    if reward_cfg.name == "even_tokens":
        return EvenTokenReward(threshold=reward_cfg.get("threshold", 0.75))
    if reward_cfg.name not in ("math", "code"):
        raise ConfigError(f"reward={reward_cfg.name} is unknown; choose math, code or even_tokens")
    own = reward_cfg if reward_cfg.name == data_spec.get("answer_type", "math") else {}
    if data_spec.get("answer_type", "math") == "code":
        from rlbench.reward.code import CodeReward
        from rlbench.sandbox import limits_from_config

        return CodeReward(
            mode=own.get("mode", "all_pass"),
            correct_reward=own.get("correct_reward", 1.0),
            incorrect_reward=own.get("incorrect_reward", 0.0),
            limits=limits_from_config(sandbox_cfg),
            workers=(sandbox_cfg or {}).get("workers"),
        )
    extraction = own.get("extraction") or data_spec.get("reward_extraction") or "auto"
    return MathReward(
        correct_reward=own.get("correct_reward", 1.0),
        incorrect_reward=own.get("incorrect_reward", 0.0),
        format_weight=own.get("format_weight", 0.0),
        tolerance=own.get("tolerance", 1e-6),
        extraction=extraction,
        verify_timeout_s=own.get("verify_timeout_s", 5.0),
    )


def load_benchmarks(cfg: DictConfig) -> list[Benchmark]:
    benchmarks = []
    for name, spec in cfg.eval.benchmarks.items():
        problems = load_problems(spec, seed=cfg.seed, data_dir=cfg.data_dir, source=cfg.data_source)
        if cfg.eval.limit is not None:
            problems = problems[: cfg.eval.limit]
        benchmarks.append(Benchmark(name, spec, problems, make_grader(cfg.reward, spec, cfg.get("sandbox"))))
    return benchmarks


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(rlbench.__file__).parent, capture_output=True, text=True, timeout=5
        ).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def versions() -> dict[str, str]:
    import transformers

    return {
        "rlbench": rlbench.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": np.__version__,
    }


@dataclass
class StepContext:
    """Everything one training step needs (built once per run by :func:`make_step_context`)."""

    algorithm: Algorithm
    model: torch.nn.Module
    tokenizer: Any
    engine: RolloutEngine
    grader: Any  # MathReward, CodeReward or EvenTokenReward (see make_grader)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    params: SamplingParams
    n: int
    prompt_spec: Any
    micro_batch_size: int
    max_grad_norm: float | None
    device: torch.device
    rollout_generator: torch.Generator
    minibatch_generator: torch.Generator
    reference: torch.nn.Module | None = None
    dynamic_sampling: DynamicSampling = DynamicSampling()
    overlong_filter: bool = False
    inputs: AdvantageInputSources | None = None  # remax/pvpo baselines, SPO tracker, answer keys
    update_state: UpdateState | None = None  # value head, EWMA proximal policy, SFPO switch


def make_step_context(
    cfg: DictConfig, algorithm: Algorithm, model: torch.nn.Module, tokenizer: Any, engine: RolloutEngine, device: torch.device
) -> StepContext:
    trainer, rollout = cfg.trainer, cfg.rollout
    update_state = make_update_state(algorithm, model)
    # The fused AdamW kernel (one pass over all parameters) is ~4x faster on CPU than the default.
    optimizer = torch.optim.AdamW(
        update_state.parameters(model), lr=trainer.lr, betas=tuple(trainer.betas), weight_decay=trainer.weight_decay, fused=True
    )
    warmup = max(int(trainer.warmup_steps), 0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (warmup + 1)))
    reference = copy.deepcopy(model).eval().requires_grad_(False) if algorithm.needs_reference else None
    ctx = StepContext(
        algorithm=algorithm,
        model=model,
        tokenizer=tokenizer,
        engine=engine,
        grader=make_grader(cfg.reward, cfg.dataset, cfg.get("sandbox")),
        optimizer=optimizer,
        scheduler=scheduler,
        params=SamplingParams(rollout.temperature, rollout.top_p, rollout.max_new_tokens),
        n=rollout.n,
        prompt_spec=cfg.dataset.prompt,
        micro_batch_size=trainer.micro_batch_size,
        max_grad_norm=trainer.max_grad_norm,
        device=device,
        rollout_generator=make_generator(cfg.seed, STREAM_ROLLOUT),
        minibatch_generator=make_generator(cfg.seed, STREAM_MINIBATCH),
        reference=reference,
        dynamic_sampling=DynamicSampling.from_config(cfg.algorithm),
        overlong_filter=bool(cfg.algorithm.get("overlong_filter", False)),
        update_state=update_state,
    )
    ctx.inputs = AdvantageInputSources.for_context(cfg, ctx)
    return ctx


def train_step(
    ctx: StepContext,
    problems: list[Problem],
    progress: float = 0.0,
    next_prompts: Callable[[int], list[Problem]] | None = None,
) -> dict[str, float]:
    """rollout -> reward -> advantage -> update for one batch of prompts. Returns step metrics.

    ``progress`` is the fraction of training done before this step (for annealed losses);
    ``next_prompts(k)`` gives k more prompts (DAPO's dynamic sampling draws them)."""
    t0 = time.perf_counter()
    # 1-2. rollout and reward: n responses per prompt, each graded against its problem's answer,
    #      plus the algorithm's reward shaping (e.g. DAPO's overlong penalty)
    graded, sampling_metrics = sample_groups(ctx, problems, next_prompts)
    t_generate = time.perf_counter() - t0
    groups, grades = graded.groups, graded.grades
    batch = collate(groups, ctx.tokenizer.pad_token_id, ctx.device)
    outcome = graded.outcome.to(ctx.device)  # the graders' rewards, before shaping
    batch.rewards = graded.rewards.to(ctx.device)  # after the algorithm's reward shaping
    finished = graded.finished.to(ctx.device)
    correct = graded.correct.to(ctx.device).bool()
    # 3. advantage (a no-grad pass first only when the estimator reads log-probs or entropies, the
    #    batch is reused for several updates, or the KL / token mask / KL controller needs them)
    t1 = time.perf_counter()
    algorithm = ctx.algorithm
    temperature = ctx.params.temperature if ctx.params.temperature > 0 else 1.0
    wanted = algorithm.advantage_inputs
    state = ctx.update_state or UpdateState()
    extra: dict[str, Any] = {"correct": correct, "max_length": ctx.params.max_new_tokens}
    if algorithm.needs_sampling_pass:
        before = batch_outputs(
            ctx.model, batch, ctx.micro_batch_size, temperature, with_entropy=algorithm.needs_sampling_entropy,
            value_head=state.value_head,
        )
        extra.update(old_logp=before.logp, entropy=before.entropy, values=before.values)
        if algorithm.needs_old_logp:
            batch.old_logp = before.logp
        batch.old_values = before.values
    provided, input_metrics = ctx.inputs.before_advantage(graded, batch) if ctx.inputs else ({}, {})
    # reference log-probs only when the KL term is active
    if ctx.reference is not None:
        batch.ref_logp, _ = batch_logprobs(ctx.reference, batch, ctx.micro_batch_size, temperature)
    advantage_rewards, response_kl = batch.rewards, None
    if algorithm.kl_in_reward or algorithm.kl_adaptive is not None:
        advantage_rewards, extra["token_rewards"], response_kl = algorithm.kl_reward_terms(
            batch.rewards, batch.response_mask, extra["old_logp"], batch.ref_logp
        )
    batch.token_weights = algorithm.token_weights(extra.get("entropy"), batch.response_mask)
    batch.advantages = algorithm.compute_advantages(
        advantage_rewards, batch.group_index, batch.response_mask, **{k: extra.get(k) for k in wanted}, **provided
    )
    if state.value_head is not None:  # the critic's targets: GAE lambda-returns of the same values
        batch.returns = value_targets(algorithm.advantage.params, advantage_rewards, batch.old_values, batch.response_mask)
    coefficients = {"kl_coef": algorithm.kl_coefficient, "entropy_coef": algorithm.entropy_coefficient}
    # 4. update
    stats = update_policy(
        ctx.model,
        ctx.optimizer,
        mask_truncated(batch, finished) if ctx.overlong_filter else batch,  # DAPO's overlong filtering
        ctx.algorithm,
        state,
        micro_batch_size=ctx.micro_batch_size,
        max_grad_norm=ctx.max_grad_norm,
        temperature=temperature,
        norm_length=ctx.params.max_new_tokens,
        generator=ctx.minibatch_generator,
        progress=progress,
    )
    algorithm.update_coefficients(
        None if response_kl is None else response_kl.mean().item(), stats.get("entropy"), batch.size
    )
    if algorithm.uses_optimizer:
        ctx.scheduler.step()
    ctx.engine.sync_weights(ctx.model)
    input_metrics.update(ctx.inputs.after_update(graded) if ctx.inputs else {})
    t_update = time.perf_counter() - t1
    step_time = time.perf_counter() - t0
    # 5. metrics
    lengths = batch.response_mask.sum(-1)
    sequence_adv = batch.advantages[:, 0]
    rewards = batch.rewards
    group_std = torch.stack([rewards[batch.group_index == g].std(correction=0) for g in range(len(groups))])
    return {
        "reward_mean": rewards.mean().item(),
        "reward_std": rewards.std().item() if len(rewards) > 1 else 0.0,
        "accuracy": float(np.mean([g.correct for g in grades])),
        "format_rate": float(np.mean([g.format_ok for g in grades])),
        "frac_zero_std_groups": float((group_std.nan_to_num(0.0) == 0).float().mean().item()),
        "advantage_mean": sequence_adv.mean().item(),
        "advantage_std": sequence_adv.std().item() if len(sequence_adv) > 1 else 0.0,
        "advantage_abs_mean": sequence_adv.abs().mean().item(),
        "response_length": lengths.float().mean().item(),
        "truncated_rate": float(1.0 - finished.float().mean().item()),
        "reward_shaping_mean": (rewards - outcome).mean().item(),
        **coefficients,
        **({"kl_sequence": response_kl.mean().item()} if response_kl is not None else {}),
        **({"token_mask_kept": (batch.token_weights.sum() / lengths.sum().clamp(min=1)).item()}
           if batch.token_weights is not None else {}),
        "grader_errors": float(sum(g.error is not None for g in grades)),
        "lr": ctx.scheduler.get_last_lr()[0],
        "generate_s": t_generate,
        "update_s": t_update,
        "step_s": step_time,
        "tokens_per_s": float(lengths.sum().item()) / step_time,
        **sampling_metrics,
        **input_metrics,
        **stats,
    }


def train(cfg: DictConfig, ctx: StepContext, problems: list[Problem], logger: RunLogger) -> None:
    sampler = PromptSampler(problems, cfg.seed)
    progress = Progress("train", cfg.trainer.steps)
    for step in range(1, cfg.trainer.steps + 1):
        progress_fraction = (step - 1) / cfg.trainer.steps
        metrics = train_step(
            ctx, sampler.next(cfg.trainer.prompts_per_step), progress=progress_fraction, next_prompts=sampler.next
        )
        logger.log_step(step, metrics)
        progress.update(1, note=f"reward {metrics['reward_mean']:.3f} acc {metrics['accuracy']:.3f}")


def save_policy(model: torch.nn.Module, tokenizer: Any, target: Path) -> None:
    """Save in Hugging Face format via a temporary folder, so a half-written checkpoint never appears."""
    tmp = target.with_name(target.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if target.exists():
        import shutil

        shutil.rmtree(target)
    tmp.rename(target)


def link_latest(out_dir: Path) -> None:
    """results/latest -> this run's folder (best effort)."""
    try:
        latest = Path("results") / "latest"
        if latest.is_symlink() or latest.exists():
            latest.unlink()
        latest.parent.mkdir(exist_ok=True)
        latest.symlink_to(out_dir.resolve(), target_is_directory=True)
    except OSError:
        pass


def print_table(result: EvalResult, baseline: EvalResult | None) -> None:
    before = {(r["benchmark"], r["k"]): r["pass_at_k"] for r in baseline.rows} if baseline else {}
    header = f"{'benchmark':<12} {'k':>3} {'pass@k':>8} {'95% CI':>17} {'maj@k':>7} {'before':>8}"
    print("\n" + header + "\n" + "-" * len(header))
    for r in result.rows:
        b = before.get((r["benchmark"], r["k"]))
        before_text = "-" if b is None else f"{b:.4f}"
        maj_text = "-" if r["maj_at_k"] != r["maj_at_k"] else f"{r['maj_at_k']:.4f}"  # NaN: answers cannot vote
        print(
            f"{r['benchmark']:<12} {r['k']:>3} {r['pass_at_k']:>8.4f} [{r['ci_low']:.4f}, {r['ci_high']:.4f}] "
            f"{maj_text:>7} {before_text:>8}"
        )
    print()


def run(cfg: DictConfig) -> dict[str, Any]:
    """Validate, train (unless mode=eval), evaluate, write results. Returns the summary."""
    started = time.perf_counter()
    algorithm = validate_config(cfg)  # every check before anything expensive
    seed_everything(cfg.seed)
    device = resolve_device(str(cfg.device))
    out_dir = Path(cfg.output_dir)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    training = cfg.mode == "train" and cfg.trainer.steps > 0

    train_problems = load_problems(cfg.dataset, seed=cfg.seed, data_dir=cfg.data_dir, source=cfg.data_source) if training else []
    benchmarks = load_benchmarks(cfg)
    logger = RunLogger(out_dir, resolved, OmegaConf.to_yaml(cfg, resolve=True), cfg.logger)
    try:
        dtype = torch.float32  # bf16 enters through autocast on CUDA; master weights stay fp32
        model, tokenizer = load_policy(cfg.model, device=device, dtype=dtype, seed=cfg.seed, cache_dir=cfg.cache_dir)
        engine = make_engine(cfg.rollout, model, tokenizer, device)
        ev = cfg.eval
        eval_params = SamplingParams(ev.temperature, ev.top_p, ev.max_new_tokens)
        eval_seed = make_generator(cfg.seed, STREAM_EVAL).initial_seed()

        def run_eval(phase: str) -> EvalResult:
            log.info("evaluating (%s) on %s", phase, ", ".join(b.name for b in benchmarks))
            result = evaluate(engine, tokenizer, benchmarks, n=ev.n, ks=list(ev.k), params=eval_params, seed=eval_seed)
            return result.with_phase(phase)

        baseline = run_eval("before") if training and ev.before_training else None
        if training:
            train(cfg, make_step_context(cfg, algorithm, model, tokenizer, engine, device), train_problems, logger)
        final = run_eval("after" if training else "eval")

        if training and cfg.trainer.save_model:
            save_policy(model, tokenizer, out_dir / "policy")
        rows = (baseline.rows if baseline else []) + final.rows
        problem_rows = (baseline.problems if baseline else []) + final.problems
        summary = {
            "run_name": cfg.run_name,
            "mode": cfg.mode,
            "algorithm": algorithm.name,
            "model": cfg.model.name,
            "dataset": cfg.dataset.name,
            "seed": cfg.seed,
            "pass_at_1_before": baseline.pass_at(1) if baseline else None,
            "pass_at_1_after": final.pass_at(1),
            "eval_seconds": {"before": baseline.seconds if baseline else None, "after": final.seconds},
            "grader_errors": {"before": baseline.grader_errors if baseline else None, "after": final.grader_errors},
            "wall_seconds": time.perf_counter() - started,
            "device": str(device),
            "versions": versions(),
            "git_commit": git_commit(),
            "command": " ".join(sys.argv),
        }
        logger.log_eval(rows, problem_rows, final.samples, summary, step=int(cfg.trainer.steps) if training else 0)
        print_table(final, baseline)
        print(f"results: {out_dir}")
    finally:
        logger.finish()
    link_latest(out_dir)
    return summary
