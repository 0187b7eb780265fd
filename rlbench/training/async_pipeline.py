"""Asynchronous training with bounded staleness (``trainer.max_staleness=k``): a generator thread
produces the rollouts of later steps while the learner updates, through a queue of batches tagged with
the policy version that sampled them.

The rule, for steps s = 1..S (policy version v = the number of updates so far):

    batch s is sampled by policy version  g(s) = max(0, s - 1 - k)
    the learner trains on batch s at version s - 1, so its staleness is (s - 1) - g(s) <= k

k = 0 is the synchronous loop run through the pipeline (batch s waits for version s - 1; nothing
overlaps; the metrics equal the synchronous run's). With k >= 1 the generator samples batch s as soon
as version g(s) is published, while the learner still trains batch s - 1, ..., s - k: generation and
update overlap. The generator samples from its own copy of the model; the learner publishes a weight
snapshot after every update (:class:`WeightSnapshots`), and the generator loads exactly version g(s)
before sampling batch s, so the run is a function of the seed alone, whatever the threads' timing.

A batch older than k versions is never trained on (:class:`StalenessGate` drops it and counts it);
versions taken from the queue are monotone. Stale responses are off-policy in every token, so the
ratio's pi_old is their stored sampling log-probs (rlbench.training.step.behaviour_old_logp), never
recomputed: off-policy corrections (M2PO's second-moment mask, truncated IS, ...) apply to them.

Threads on CPU: the generator thread sets its own torch thread count (``trainer.generator_threads``;
null: the process's count), the learner keeps the process's. On GPU with vLLM the same design holds:
the generator thread calls ``engine.sync_weights`` with the snapshot it loaded, so the inference
engine's weights are refreshed once per version.

Syncing every j versions (``trainer.weight_sync_every=j``, DART's per-worker model synchronisation,
arXiv:2509.23866 section 3; 1 = every version, the rule above): only the versions 0, j, 2j, ... are
published to the generator, and batch s is sampled by the first synced version at or after g(s),

    g_j(s) = j * ceil(g(s) / j)        (g_1 = g)

Rounding g(s) up, not down, keeps every batch within the bound: staleness (s - 1) - g_j(s) <= k.
Rounding down would leave batches up to k + j - 1 versions old, which the gate drops. g_j(s) must
also exist when batch s is due, g_j(s) <= s - 1: every run of k + 1 consecutive versions must hold a
multiple of j, i.e. j <= k + 1 (validation refuses a larger j, rlbench.validation.check_staleness).

Refused with k >= 1 (before the model loads, rlbench.validation): a piece that needs on-policy data
(registry.Needs.on_policy, e.g. loss ``reinforce``), advantage inputs that sample at the learner
(ReMax's greedy and PVPO's reference rollouts share the engine), ``trainer.stages`` (a stage would
change the sampling settings under a batch being trained) and ``eval.every`` (the evaluation shares the
engine with the generator).
"""

from __future__ import annotations

import copy
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from rlbench.rollout.groups import GradedGroups
from rlbench.training.curricula import Curriculum
from rlbench.training.step import StepContext, learn_step, stamp_policy_version


def generator_version(step: int, max_staleness: int, sync_every: int = 1) -> int:
    """g_j(s): the policy version that samples batch ``step`` (1-based): g(s) = max(0, s - 1 - k)
    rounded up to a multiple of j = ``sync_every`` (module docstring)."""
    if sync_every < 1 or sync_every > max_staleness + 1:
        raise ValueError(f"sync_every must be in 1..max_staleness + 1 = {max_staleness + 1}, got {sync_every}")
    version = max(0, step - 1 - max_staleness)
    return -(-version // sync_every) * sync_every


@dataclass
class RolloutBatch:
    """One step's graded groups with the version that sampled them and the generator's measurements."""

    step: int
    version: int
    graded: GradedGroups
    rollout_metrics: dict[str, float]
    generation_cost: dict[str, float]
    generate_s: float
    interval: tuple[float, float]  # perf_counter start and end of the generation


class WeightSnapshots:
    """Weight versions published by the learner and read by the generator in increasing order (the
    first k + 1 batches all read version 0)."""

    def __init__(self) -> None:
        self.condition = threading.Condition()
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self.closed = False

    def publish(self, version: int, model: torch.nn.Module) -> None:
        weights = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
        with self.condition:
            self.snapshots[version] = weights
            self.condition.notify_all()

    def take(self, version: int) -> dict[str, torch.Tensor] | None:
        """Version ``version``'s weights (waiting for them), dropping older versions; None once closed."""
        with self.condition:
            self.condition.wait_for(lambda: version in self.snapshots or self.closed)
            if version not in self.snapshots:
                return None
            weights = self.snapshots[version]
            for old in [v for v in self.snapshots if v < version]:
                del self.snapshots[old]
            return weights

    def close(self) -> None:
        with self.condition:
            self.closed = True
            self.condition.notify_all()


@dataclass
class StalenessGate:
    """Admits a batch only when it is at most ``max_staleness`` versions behind the learner and not
    older than the last admitted one (versions are monotone); counts what it drops."""

    max_staleness: int
    last_version: int = -1
    dropped: int = 0

    def admit(self, batch_version: int, learner_version: int) -> bool:
        staleness = learner_version - batch_version
        if staleness > self.max_staleness or staleness < 0 or batch_version < self.last_version:
            self.dropped += 1
            return False
        self.last_version = batch_version
        return True


@dataclass
class OverlapClock:
    """Busy intervals of the generator and the learner: how much of the wall time they overlapped."""

    generator: list[tuple[float, float]] = field(default_factory=list)
    learner: list[tuple[float, float]] = field(default_factory=list)

    def summary(self, wall: float) -> dict[str, float]:
        both = sum(max(0.0, min(g1, l1) - max(g0, l0)) for g0, g1 in self.generator for l0, l1 in self.learner)
        return {
            "async_wall_s": wall,
            "async_generate_s": sum(b - a for a, b in self.generator),
            "async_update_s": sum(b - a for a, b in self.learner),
            "async_overlap_s": both,
            "async_overlap_share": both / wall if wall > 0 else 0.0,
        }


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


class AsyncPipeline:
    """The generator thread and the learner's side of the queue (module docstring)."""

    def __init__(self, ctx: StepContext, curriculum: Curriculum, steps: int, max_staleness: int,
                 generator_threads: int | None = None, sync_every: int = 1):
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        generator_version(1, max_staleness, sync_every)  # refuses a sync_every the bound cannot hold
        self.ctx, self.curriculum, self.steps_total, self.max_staleness = ctx, curriculum, steps, max_staleness
        self.sync_every = sync_every
        self.generator_threads = generator_threads
        self.engine = ctx.engine
        self.generator_model = copy.deepcopy(ctx.model).eval().requires_grad_(False)
        self.snapshots = WeightSnapshots()
        self.batches: "queue.Queue[RolloutBatch | _Failure]" = queue.Queue()
        self.gate = StalenessGate(max_staleness)
        self.clock = OverlapClock()
        self.versions: list[int] = []
        self.wall = 0.0

    # -- generator thread

    def _generate(self) -> None:
        try:
            if self.generator_threads:
                torch.set_num_threads(int(self.generator_threads))
            ctx, curriculum = self.ctx, self.curriculum
            for step in range(1, self.steps_total + 1):
                version = generator_version(step, self.max_staleness, self.sync_every)
                weights = self.snapshots.take(version)
                if weights is None:
                    return
                self.generator_model.load_state_dict(weights)
                self.engine.sync_weights(self.generator_model)
                t0 = time.perf_counter()
                graded, rollout_metrics = ctx.strategy.rollout(curriculum.prompts(step, ctx), curriculum.draw)
                t1 = time.perf_counter()
                stamp_policy_version(graded, version)
                curriculum.observe(step, graded)
                curriculum.end_step(step)
                self.batches.put(RolloutBatch(step, version, graded, rollout_metrics, ctx.sampler.cost.take(), t1 - t0, (t0, t1)))
        except BaseException as error:  # the learner re-raises it
            self.batches.put(_Failure(error))

    # -- the learner

    def steps(self) -> Iterator[tuple[int, dict[str, float]]]:
        """Train on the batches in order, yielding (step, metrics); the generator runs meanwhile."""
        ctx = self.ctx
        start = time.perf_counter()
        self.ctx.engine = _PublishingEngine(self.snapshots, ctx.policy_version, self.sync_every)
        self.snapshots.publish(ctx.policy_version, ctx.model)
        thread = threading.Thread(target=self._generate, name="rlbench-generator", daemon=True)
        thread.start()
        try:
            trained = 0
            while trained < self.steps_total:
                waited = time.perf_counter()
                item = self.batches.get()
                if isinstance(item, _Failure):
                    raise item.error
                if not self.gate.admit(item.version, ctx.policy_version):
                    continue
                t0 = time.perf_counter()
                metrics = learn_step(ctx, item.graded, item.rollout_metrics, (item.step - 1) / self.steps_total,
                                     item.generate_s, started=t0, generation_cost=item.generation_cost)
                self.clock.learner.append((t0, time.perf_counter()))
                self.clock.generator.append(item.interval)
                self.versions.append(item.version)
                trained += 1
                metrics.update(staleness=float(ctx.policy_version - 1 - item.version), queue_wait_s=t0 - waited)
                yield item.step, metrics
        finally:
            self.snapshots.close()
            thread.join()
            self.ctx.engine = self.engine
            self.engine.sync_weights(ctx.model)  # evaluation after training samples from the trained policy
            self.wall = time.perf_counter() - start

    def summary(self) -> dict[str, Any]:
        """What the run's summary reports: the bound, batches dropped, and the overlap of the two threads."""
        return {"max_staleness": self.max_staleness, "weight_sync_every": self.sync_every,
                "async_weight_syncs": len(set(self.versions)), "async_dropped_batches": self.gate.dropped,
                **self.clock.summary(self.wall)}


class _PublishingEngine:
    """Stands in for the engine at the learner: ``sync_weights`` after an update publishes the new
    version's snapshot for the generator instead of pointing the engine at the live model; only the
    versions the generator syncs to (multiples of ``sync_every``) are copied."""

    def __init__(self, snapshots: WeightSnapshots, version: int, sync_every: int = 1):
        self.snapshots, self.version, self.sync_every = snapshots, version, sync_every

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.version += 1
        if self.version % self.sync_every == 0:
            self.snapshots.publish(self.version, model)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("with trainer.max_staleness set, only the generator thread samples")
