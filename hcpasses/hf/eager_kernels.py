"""One context for a compiled transformers HC model to run the kernels its eager forward runs.

It opens :func:`~hcpasses.hf.export_check.export_check_read_from_flag` (torch 2.11's Dynamo takes transformers'
export branches under ``torch.compile``), :func:`~hcpasses.hf.delta_rule_op.delta_rule_as_one_op` (the
chunked delta rule as one op: no unrolled chunk loop, no graph break around flash-linear-attention) and
:func:`~hcpasses.hf.qsa_selection_op.qsa_selection_as_one_op` (qwen4_exp's QSA token selection as one op: no graph
break at every query position). Open it after the model is built, and keep the compiled model's calls inside it:
Dynamo reads what it patches when it traces.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from hcpasses.hf.delta_rule_op import delta_rule_as_one_op
from hcpasses.hf.export_check import export_check_read_from_flag
from hcpasses.hf.qsa_selection_op import qsa_selection_as_one_op


@contextlib.contextmanager
def eager_kernels_under_compile(qsa_batched: bool = False) -> Iterator[dict[str, list[str]]]:
    """Yields the modules patched: ``{"export_check": [...], "delta_rule_op": [...], "qsa_selection_op": [...]}``.
    ``qsa_batched``: the QSA selection for all queries at once (``hcpasses.hf.qsa_batched``; opt-in)."""
    with (
        export_check_read_from_flag() as checks,
        delta_rule_as_one_op() as delta_rules,
        qsa_selection_as_one_op(batched=qsa_batched) as selections,
    ):
        yield {"export_check": checks, "delta_rule_op": delta_rules, "qsa_selection_op": selections}
