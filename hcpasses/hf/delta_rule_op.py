"""transformers' chunked gated delta rule as one custom op, so that Dynamo neither unrolls it nor breaks around it.

Why: a compiled GatedDeltaNet (qwen4_exp) reaches ``torch_chunk_gated_delta_rule``, transformers' kernel
wrapper, and then one of two things happens, both bad for a prefill graph:

- with flash-linear-attention installed the wrapper calls ``fla``'s ``chunk_gated_delta_rule``, which is
  ``torch.compiler.disable``d: Dynamo breaks the graph there, in every frame of the call stack, and a one-layer
  real-size qwen4_exp becomes 9 graphs (H200, torch 2.11, 2026-12-03). No graph then holds an all-reduce
  and the HC block it feeds, so SP finds nothing to shard;
- without it the torch reference is traced: a Python loop over the chunks (T / 64 of them) that Dynamo
  unrolls, hundreds of small kernels per layer.

``delta_rule_as_one_op()`` points every loaded transformers module's ``torch_chunk_gated_delta_rule`` at a
function that calls ``hcpasses::chunk_gated_delta_rule`` (``torch.library.custom_op``): opaque to Dynamo and
Inductor (one extern call), whose body calls the wrapper the module had, eagerly, so it runs exactly what
eager runs (fla's kernels where installed, else the torch reference). Its fake implementation gives the
output ``[B, T, HV, V]`` in the query's dtype and the final state ``[N, HV, K, V]`` in float32, both
contiguous; the body checks the kernel's outputs against them and makes them contiguous. A call the op does
not cover (a ``chunk_size`` other than 64, an extra keyword argument that is neither None nor False) goes to
the module's wrapper unchanged. The module attributes are restored on exit.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hcpasses.hf.module_patch import loaded_modules_with, module_attributes_replaced

FUNCTION_NAME = "torch_chunk_gated_delta_rule"
DEFAULT_CHUNK = 64  # fla's kernels have a fixed chunk of 64; transformers' default


def _replaced(function: Callable[..., Any]) -> Callable[..., Any]:
    """What an op caller of :func:`_as_one_op` replaced; any other function itself. (Read from ``__dict__``: the
    attribute this module sets, not one that an object answering every name, such as a mock, makes up.)"""
    return getattr(function, "__dict__", {}).get("replaced_wrapper", function)


def _module_wrapper(module_name: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    """The wrapper the module had before :func:`delta_rule_as_one_op` replaced it (or has now, outside it)."""
    return _replaced(getattr(importlib.import_module(module_name), FUNCTION_NAME))


def _output_shapes(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor | None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    sequences = value.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return tuple(value.shape), (sequences, value.shape[2], key.shape[3], value.shape[3])


def _run_delta_rule(
    module_name: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool,
    cu_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The module's delta rule, run eagerly; the final state is empty when ``output_final_state`` is False."""
    out, state = _module_wrapper(module_name)(
        query,
        key,
        value,
        g=g,
        beta=beta,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens,
    )
    out_shape, state_shape = _output_shapes(query, key, value, cu_seqlens)
    _check("output", out, out_shape, query.dtype)
    # contiguous, as the fake says: the torch reference returns a view of its chunk-padded buffer
    if not output_final_state:
        return out.contiguous(), query.new_empty(0, dtype=torch.float32)
    _check("final state", state, state_shape, torch.float32)
    return out.contiguous(), state.contiguous()


def _check(what: str, tensor: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    # Inductor plans buffers from the fake implementation: a kernel that returns anything else must fail here.
    if tensor is None or tuple(tensor.shape) != shape or tensor.dtype != dtype:
        got = None if tensor is None else (tuple(tensor.shape), tensor.dtype)
        raise RuntimeError(f"hcpasses::chunk_gated_delta_rule: the kernel's {what} is {got}, expected {shape} {dtype}")


chunk_gated_delta_rule = torch.library.custom_op("hcpasses::chunk_gated_delta_rule", mutates_args=())(_run_delta_rule)
_SIGNATURE = inspect.signature(_run_delta_rule)


@chunk_gated_delta_rule.register_fake
def _(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    # bound to the op's own signature: torch.library passes the arguments positionally or by name
    call = _SIGNATURE.bind(*args, **kwargs).arguments
    query, key, value = call["query"], call["key"], call["value"]
    out_shape, state_shape = _output_shapes(query, key, value, call["cu_seqlens"])
    state = query.new_empty(state_shape if call["output_final_state"] else (0,), dtype=torch.float32)
    return query.new_empty(out_shape), state


def _as_one_op(module_name: str, wrapper: Callable[..., Any]) -> Callable[..., Any]:
    # in a nested context the module already holds an op caller: wrap what it replaced (else the op would call
    # itself through the outer caller without end)
    wrapper = _replaced(wrapper)

    @functools.wraps(wrapper)
    def delta_rule(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        chunk_size: int = DEFAULT_CHUNK,
        initial_state: torch.Tensor | None = None,
        output_final_state: bool = False,
        use_qk_l2norm_in_kernel: bool = False,
        cu_seqlens: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # extras are the model's flags passed along (output_router_logits=False); a set one may be a kernel option
        if chunk_size != DEFAULT_CHUNK or any(extra is not None and extra is not False for extra in kwargs.values()):
            return wrapper(
                query, key, value, g=g, beta=beta, chunk_size=chunk_size, initial_state=initial_state,
                output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                cu_seqlens=cu_seqlens, **kwargs,
            )  # fmt: skip
        out, state = torch.ops.hcpasses.chunk_gated_delta_rule(
            module_name, query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel,
            cu_seqlens,
        )  # fmt: skip
        return out, state if output_final_state else None

    delta_rule.replaced_wrapper = wrapper  # type: ignore[attr-defined]  # the op's body calls it
    return delta_rule


@contextlib.contextmanager
def delta_rule_as_one_op() -> Iterator[list[str]]:
    """While open, the loaded transformers modules' chunked delta rule is ``hcpasses::chunk_gated_delta_rule``.

    Yields the names of the modules it patched. Dynamo reads the module attribute when it traces (first call,
    recompiles): keep the compiled model's calls inside the context."""
    names = loaded_modules_with(FUNCTION_NAME, "transformers.models")
    with module_attributes_replaced(names, FUNCTION_NAME, _as_one_op) as patched:
        yield patched
