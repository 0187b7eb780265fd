"""rlbench.training.memory.keep_freed_memory, which tests/conftest.py applies to the test processes and CPU
training to its own (glibc's malloc tuned by MALLOC_TUNING): a
large block allocated again after it was freed takes no new pages from the kernel, in the pytest process and
in the processes that tests start; without the tuning every allocation takes new pages."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rlbench.training.memory import MALLOC_TUNING, keep_freed_memory

BLOCK_BYTES = 64 * 2**20
# Minor page faults per allocation of a freed-and-reallocated 64 MiB block, printed by a fresh process.
NEW_PAGES_PER_ALLOCATION = """
import resource
def new_pages_per_allocation(nbytes, repeats=8):
    bytearray(nbytes)  # the first allocation takes its pages
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(repeats):
        block = bytearray(nbytes)  # malloc, then written through (zeroed)
        del block
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / repeats
"""
BLOCK_PAGES = BLOCK_BYTES / os.sysconf("SC_PAGE_SIZE")

pytestmark = pytest.mark.skipif(not keep_freed_memory(), reason="the C library has no mallopt (not glibc)")


def pages_in_child(env: dict) -> float:
    code = NEW_PAGES_PER_ALLOCATION + f"print(new_pages_per_allocation({BLOCK_BYTES}))"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return float(proc.stdout)


def test_this_process_reuses_freed_memory():
    namespace: dict = {}
    exec(NEW_PAGES_PER_ALLOCATION, namespace)
    assert namespace["new_pages_per_allocation"](BLOCK_BYTES) < BLOCK_PAGES / 8


def test_a_started_process_inherits_the_tuning_and_without_it_takes_new_pages():
    assert all(name in os.environ for name in MALLOC_TUNING)
    assert pages_in_child(dict(os.environ)) < BLOCK_PAGES / 8
    untuned = {k: v for k, v in os.environ.items() if k not in MALLOC_TUNING}
    assert pages_in_child(untuned) > BLOCK_PAGES / 2  # the measurement sees the difference


CPU_TRAINING_SETUP = """
import sys, torch
from hydra import compose, initialize_config_dir
from rlbench.algorithm import Algorithm
from rlbench.config.typed import algorithm_settings, typed_config
from rlbench.reward.graders import training_grader
from rlbench.training.step import make_step_context
with initialize_config_dir(config_dir=sys.argv[1], version_base="1.3"):
    cfg = compose("config", overrides=["experiment=smoke", f"trainer.reuse_freed_memory={sys.argv[2]}", f"output_dir={sys.argv[3]}"])
make_step_context(typed_config(cfg), Algorithm.from_config(algorithm_settings(typed_config(cfg).algorithm)), torch.nn.Linear(2, 2), None, None, torch.device("cpu"),
                  training_grader(typed_config(cfg)))
"""


@pytest.mark.parametrize("reuse", [True, False])
def test_cpu_training_keeps_freed_memory_unless_turned_off(reuse, tmp_path):
    """make_step_context on CPU applies keep_freed_memory (trainer.reuse_freed_memory, default on): in a
    process started without the tuning, a freed large block is reused; turned off, it takes new pages."""
    from conftest import CONF_DIR

    code = CPU_TRAINING_SETUP + NEW_PAGES_PER_ALLOCATION + f"print(new_pages_per_allocation({BLOCK_BYTES}))"
    untuned = {k: v for k, v in os.environ.items() if k not in MALLOC_TUNING}
    proc = subprocess.run([sys.executable, "-c", code, CONF_DIR, str(reuse).lower(), str(tmp_path / "run")], env=untuned,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pages = float(proc.stdout.strip().splitlines()[-1])
    assert pages < BLOCK_PAGES / 8 if reuse else pages > BLOCK_PAGES / 2
