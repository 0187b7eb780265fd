"""Guidance for the methods that learn from responses the policy did not sample: the traces
(rlbench.guidance.traces) and the command that writes graded trace files (rlbench.guidance.generate)."""

from rlbench.guidance.traces import (
    GuidanceLibrary,
    GuidanceOptions,
    Trace,
    load_guidance,
    trace_completion,
)

__all__ = ["GuidanceLibrary", "GuidanceOptions", "Trace", "load_guidance", "trace_completion"]
