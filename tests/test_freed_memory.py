"""tests/conftest.py keeps freed memory in the test processes (glibc's malloc tuned by MALLOC_TUNING): a
large block allocated again after it was freed takes no new pages from the kernel, in the pytest process and
in the processes that tests start; without the tuning every allocation takes new pages."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import MALLOC_TUNING, keep_freed_memory

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
