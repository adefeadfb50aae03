"""Make transformers' "am I exporting?" check true to ``torch.compile`` on torches whose Dynamo folds it to True.

Why this exists: Dynamo before pytorch/pytorch#176499 (torch 2.13 has the fix, 2.11 does not) traces
``torch.compiler.is_exporting()`` as the constant ``True`` under ``torch.compile`` as well as under
``torch.export``. transformers asks ``is_torchdynamo_exporting()`` (which calls it) exactly where a compiled
qwen4_exp decides what to run:

- ``use_kernel_func_from_hub_with_fallback`` skips an installed kernel package (flash-linear-attention's
  ``chunk_gated_delta_rule``) for its torch reference "when exporting";
- that reference (``torch_chunk_gated_delta_rule``) then inverts its triangular system by a forward
  substitution of ``chunk_size - 1`` steps (slices, clones and a sum each) instead of
  ``torch.linalg.solve_triangular``.

So on torch 2.11 a compiled GatedDeltaNet runs hundreds of small kernels per layer where eager runs the
flash-linear-attention kernels (or two triangular solves without them). :func:`export_check_read_from_flag`
points every loaded transformers module's ``is_torchdynamo_exporting`` at the flag torch's export sets
(``torch.compiler._is_exporting_flag``, the value the fixed Dynamo reads) while the context is open, and
restores them on exit. Where Dynamo does not fold the check (:func:`dynamo_folds_is_exporting` is False) it
changes nothing. Dynamo reads the check when it traces, i.e. on a compiled call's first use and on every
recompile: keep the calls of the compiled model inside the context.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from hcpasses.hf.module_patch import loaded_modules_with, module_attributes_replaced

CHECK_NAME = "is_torchdynamo_exporting"


def _is_exporting_per_flag() -> bool:
    # The flag is internal: tests/real_models/test_export_check.py pins that export sets it and that it is
    # False otherwise.
    return bool(torch.compiler._is_exporting_flag)


def _asks_if_exporting(x: torch.Tensor) -> torch.Tensor:
    return x + 1 if torch.compiler.is_exporting() else x


def dynamo_folds_is_exporting() -> bool:
    """Whether this torch's Dynamo traces ``torch.compiler.is_exporting()`` as True under ``torch.compile``.

    Decided by tracing a two-line probe with the ``eager`` backend, not by the version number."""
    probe = torch.compile(_asks_if_exporting, backend="eager", fullgraph=True, dynamic=False)
    return bool(probe(torch.zeros(1)).item() == 1)


@contextlib.contextmanager
def export_check_read_from_flag() -> Iterator[list[str]]:
    """While open, transformers' ``is_torchdynamo_exporting`` is False under ``torch.compile`` on every torch.

    Yields the names of the modules it patched (empty where Dynamo does not fold the check, or when transformers
    is not loaded). Modules imported after entering are not patched: build the model first."""
    if not dynamo_folds_is_exporting():
        yield []
        return
    names = loaded_modules_with(CHECK_NAME, "transformers")
    with module_attributes_replaced(names, CHECK_NAME, lambda name, check: _is_exporting_per_flag) as patched:
        yield patched
