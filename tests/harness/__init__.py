"""Test harness: capture post-grad graphs per rank and run them on virtual ranks in one process."""

from .capture import (
    CapturedGraph,
    CaptureError,
    GroupLayout,
    capture_post_grad,
    capture_ranks,
    check_inputs,
    compile_without_codegen,
    count_calls,
    fake_process_group,
    fake_tp_group,
    passes_run_every_compile,
    simulate_captured,
    tp_group_name,
)
from .simulator import CollectiveMismatchError, CollectiveTimeoutError, simulate, simulate_compiled

__all__ = [
    "CaptureError",
    "CapturedGraph",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "GroupLayout",
    "capture_post_grad",
    "capture_ranks",
    "check_inputs",
    "compile_without_codegen",
    "count_calls",
    "fake_process_group",
    "fake_tp_group",
    "passes_run_every_compile",
    "simulate",
    "simulate_captured",
    "simulate_compiled",
    "tp_group_name",
]
