"""QRPO's reference set: K rewards of pi_ref samples per prompt, sampled once and kept on disk.

QRPO (Matrenok et al., arXiv 2507.08068, Sec. 3) turns a response's reward into its quantile among the
rewards of K responses y'_k ~ pi_ref(.|x) to the same prompt. pi_ref is frozen and the grader is fixed, so
those K rewards are a function of the prompt: :class:`ReferenceRewardCache` samples them once per prompt
(through a caller-supplied ``sample`` function: the frozen reference with its own seeded generator, graded
by the run's grader) and keeps them in a JSON file, so a second run or a resume does not resample.

The file is keyed by :func:`reference_rewards_identity`: the reference's identity (its weights'
fingerprint), K, the sampling settings and the grader. A file of another identity is never read: its
entries are dropped (one logged line) and resampled. Entries are keyed by a hash of the prompt's text.
The step's source is :class:`ReferenceRewards` (``algorithm.qrpo.reference_samples = K > 0``): for the step's
prompts not yet cached it samples K responses of pi_ref (the run's frozen reference, through an HF engine of
its own over it), each prompt with its own seed (:func:`prompt_seed`: the run's seed and the prompt, so the
policy's random stream is untouched and a prompt's K samples are the same whenever they are drawn: a resumed
run or a cache hit changes nothing), grades them with the run's reward (the sampler's grader, reward terms and
shaping, the scale of the trained responses' rewards) and gives each trained response its prompt's row
(``TrainBatch.reference_rewards`` [B, K], read by rlbench/algorithm/losses/quantile_reward.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.rollout import GradedGroups, GroupSampler
from rlbench.rollout.engines import frozen_model_engine
from rlbench.rollout.groups import GenerationCost
from rlbench.rollout.engines.base import GenerationRequest, SamplingParams
from rlbench.training.reference_cache import weights_fingerprint
from rlbench.utils import atomic_write_json

log = logging.getLogger(__name__)

FORMAT = "rlbench-reference-rewards-1"


def check_reference_samples(count: Any) -> int:
    """K as an int >= 0 (0: QRPO's in-group reference, no separate samples); a clear error otherwise."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ConfigError(f"algorithm.qrpo.reference_samples must be an integer >= 0 (0 = the in-group "
                          f"reference set), got {count!r}")
    return count


def prompt_key(prompt: str) -> str:
    """sha256 of the prompt's text: an entry's key."""
    return hashlib.sha256(prompt.encode()).hexdigest()


def reference_rewards_identity(model_identity: str, samples: int, sampling: dict[str, Any],
                               grader: str) -> dict[str, Any]:
    """What the cached rewards depend on: the reference, K, the sampling settings and the grader."""
    return {"model": model_identity, "samples": check_reference_samples(samples),
            "sampling": {name: sampling[name] for name in sorted(sampling)}, "grader": grader}


class ReferenceRewardCache:
    """Per-prompt K reference rewards, loaded from and saved to ``path`` (``None``: in memory only)."""

    def __init__(self, identity: dict[str, Any], path: str | Path | None = None) -> None:
        self.identity = identity
        self.samples = int(identity["samples"])
        if self.samples < 1:
            raise ConfigError("a reference reward cache needs K >= 1 reference samples per prompt")
        self.path = Path(path) if path is not None else None
        self.entries: dict[str, list[float]] = {}
        self.sampled = 0
        if self.path is not None and self.path.exists():
            stored = json.loads(self.path.read_text())
            if stored.get("format") == FORMAT and stored.get("identity") == identity:
                self.entries = {key: [float(r) for r in rewards] for key, rewards in stored["entries"].items()}
            else:
                log.info("reference reward cache %s: another identity (%s), its %d entries are dropped and "
                         "resampled", self.path, stored.get("identity"), len(stored.get("entries", {})))

    def rewards(self, prompts: Sequence[str],
                sample: Callable[[list[str]], Sequence[Sequence[float]]]) -> torch.Tensor:
        """[len(prompts), K] rewards; ``sample(missing prompts)`` is called once for the prompts not cached
        (never when all are) and must return K rewards per prompt. New entries are saved atomically."""
        keys = [prompt_key(prompt) for prompt in prompts]
        missing = list(dict.fromkeys(p for p, k in zip(prompts, keys) if k not in self.entries))
        if missing:
            fresh = sample(missing)
            if len(fresh) != len(missing) or any(len(row) != self.samples for row in fresh):
                raise ValueError(f"reference sampler returned {[len(row) for row in fresh]} rewards for "
                                 f"{len(missing)} prompts, expected {self.samples} each")
            for prompt, row in zip(missing, fresh):
                self.entries[prompt_key(prompt)] = [float(r) for r in row]
            self.sampled += len(missing)
            self.save()
        return torch.tensor([self.entries[key] for key in keys], dtype=torch.float64)

    def save(self) -> None:
        if self.path is not None:
            atomic_write_json(self.path, {"format": FORMAT, "identity": self.identity, "entries": self.entries})


def problem_key(problem: Problem) -> str:
    """What a prompt's reference rewards depend on besides the cache's identity: its uid, text and answer."""
    return json.dumps([problem.uid, problem.prompt, problem.answer])


def prompt_seed(run_seed: int, key: str) -> int:
    """The seed of a prompt's K reference samples (31 bits): from the run's seed and :func:`problem_key`."""
    return int(hashlib.sha256(f"{int(run_seed)}|{key}".encode()).hexdigest()[:8], 16) % (2**31 - 1)


@dataclass
class ReferenceRewards:
    """QRPO's reference set as a step input: K graded pi_ref samples per prompt, cached (module docstring)."""

    cache: ReferenceRewardCache
    sampler: GroupSampler  # the run's grader, reward terms and shaping, on pi_ref's engine
    params: SamplingParams
    seed: int

    @classmethod
    def from_config(cls, config: Any, reference: torch.nn.Module, sampler: GroupSampler, params: SamplingParams,
                    shaping: Any, device: Any) -> ReferenceRewards:
        """``config``: the typed run config with algorithm.qrpo.reference_samples = K > 0; ``reference``: the
        frozen pi_ref; ``sampler``: the run's (its grader, prompt template, reward terms and shaping are reused);
        ``shaping``: the algorithm's reward shaping pieces (part of the cache's identity)."""
        qrpo = config.algorithm.qrpo
        sampling = {"temperature": params.temperature, "top_p": params.top_p, "max_new_tokens": params.max_new_tokens,
                    "seed": int(config.seed), "prompt": json.dumps(sampler.prompt_spec, sort_keys=True, default=str)}
        grader = json.dumps({"reward": dataclasses.asdict(config.reward), "shaping": repr(shaping)}, sort_keys=True, default=str)
        identity = reference_rewards_identity(weights_fingerprint(reference), qrpo.reference_samples, sampling,
                                              hashlib.sha256(grader.encode()).hexdigest())
        path = qrpo.reference_cache or Path(config.output_dir) / "reference_rewards.json"
        engine = frozen_model_engine(config.rollout, reference, sampler.tokenizer, device)
        # its own cost counter and reward composer (the same terms): the step's metrics (generated responses,
        # reward_term_*) and the composer's step count stay the policy's, so that a run reading the cache (a
        # resumed run, a second run) logs the metrics of one that sampled; each sampling is logged instead
        own = dataclasses.replace(sampler, engine=engine, cost=GenerationCost(), compose=sampler.compose.sibling())
        return cls(ReferenceRewardCache(identity, path), own, params, int(config.seed))

    def sample(self, problems: Sequence[Problem]) -> list[list[float]]:
        """K graded pi_ref responses per problem, each problem from its own seed: their rewards [P][K]."""
        k = self.cache.samples
        requests = [GenerationRequest(prompt_ids=ids, n=k, seed=prompt_seed(self.seed, problem_key(problem)))
                    for ids, problem in zip(self.sampler.encode(problems), problems)]
        start = time.perf_counter()
        groups = self.sampler.generate(requests, self.params, None)
        rewards = self.sampler.grade(problems, groups, self.params.max_new_tokens).rewards
        log.info("QRPO reference set: %d prompts x %d pi_ref samples graded in %.1f s (cache %s: %d prompts)",
                 len(problems), k, time.perf_counter() - start, self.cache.path, len(self.cache.entries) + len(problems))
        return rewards.view(len(problems), k).tolist()

    def rows(self, graded: GradedGroups) -> torch.Tensor:
        """[B, K]: each trained response's row, its prompt's K reference rewards (sampled for prompts not cached)."""
        keys = [problem_key(problem) for problem in graded.problems]
        by_key = dict(zip(keys, graded.problems))
        per_prompt = self.cache.rewards(keys, lambda missing: self.sample([by_key[key] for key in missing]))
        sizes = torch.tensor([len(group) for group in graded.groups])
        return per_prompt.to(torch.float32).repeat_interleave(sizes, dim=0)

