"""One context for a compiled transformers HC model to run the kernels its eager forward runs.

It opens :func:`~hcpasses.hf.export_check.export_check_read_from_flag` (torch 2.11's Dynamo takes transformers'
export branches under ``torch.compile``) and :func:`~hcpasses.hf.delta_rule_op.delta_rule_as_one_op` (the
chunked delta rule as one op: no unrolled chunk loop, no graph break around flash-linear-attention). Open it after
the model is built, and keep the compiled model's calls inside it: Dynamo reads what it patches when it traces.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from hcpasses.hf.delta_rule_op import delta_rule_as_one_op
from hcpasses.hf.export_check import export_check_read_from_flag


@contextlib.contextmanager
def eager_kernels_under_compile() -> Iterator[dict[str, list[str]]]:
    """Yields the modules patched: ``{"export_check": [...], "delta_rule_op": [...]}``."""
    with export_check_read_from_flag() as checks, delta_rule_as_one_op() as delta_rules:
        yield {"export_check": checks, "delta_rule_op": delta_rules}
