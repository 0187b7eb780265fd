"""The random streams of an evaluation's samples."""

from __future__ import annotations

import hashlib


def problem_seed(seed: int, benchmark: str, uid: str) -> int:
    """The random stream of one problem's samples: a function of the run's eval seed, the
    benchmark's name and the problem's uid alone, so a benchmark's samples (and pass@k) are the same
    whatever else the suite evaluates, in whatever order."""
    digest = hashlib.sha256(f"{int(seed)}\0{benchmark}\0{uid}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 2
