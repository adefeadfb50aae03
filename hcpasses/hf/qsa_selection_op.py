"""transformers' QSA token selection (qwen4_exp's indexed attention) as one custom op, so that Dynamo traces the
attention layer as one graph instead of breaking it at every query position.

Why: ``Qwen4ExpTextQSAIndexer._select_tokens`` loops over the query positions in Python and, for each, calls
``torch.nonzero`` on the keys that query sees, then branches on how many it found. ``nonzero``'s output size depends
on the data, so Dynamo breaks the graph there, once per query position, until its recompile limit sends the rest of
the frame to eager (a 2-layer tiny qwen4_exp at T = 16: 13 graphs). No graph then holds the attention sub-layer with
its all-reduce and the HC block around it, and a compiled ``generate`` is impractically slow (over 15 minutes for the
tiny model on CPU).

``qsa_selection_as_one_op()`` replaces the method on the ``Qwen4ExpTextQSAIndexer`` class of every loaded
transformers module that defines it, for a ``with`` block, by one that calls ``hcpasses::qsa_select_tokens``
(``torch.library.custom_op``): opaque to Dynamo and Inductor (one extern call) and run eagerly, so the selection is
exactly eager's, loop and all (the op makes it one graph, not faster). Its body calls the class's own method on a
stand-in indexer that holds what the method reads: the token budget, the compress ratio, the block top-k (budget //
ratio), the index head dim and the key norm, rebuilt as the module's own norm class with the indexer's weight and
eps. The method's result is the selection mask ``[B, 1, S, kv]`` (bool; the op returns it contiguous, as its fake
says). The method reads none of its keyword arguments (transformers 5.25), which the op drops. The op is
tagged ``cudagraph_unsafe``: its loop syncs with the host at every query, so with ``cudagraphs=True`` a decode graph
holding it is not captured (Inductor skips it, or captures around it where it partitions graphs).

A call the op does not cover goes to the class's method unchanged (and Dynamo breaks the graph there as before): an
indexer whose fields are not those (``block_topk != token_budget // compress_ratio``, a key norm with other
attributes or a group size). The class attributes are restored on exit. transformers 5.24 has no ``_select_tokens``
(its loop sits inside ``forward``): its class is left as it is, and the context logs a warning that names it.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from hcpasses.hf.qsa_batched import select_tokens_batched

CLASS_NAME = "Qwen4ExpTextQSAIndexer"
METHOD_NAME = "_select_tokens"
logger = logging.getLogger(__name__)


def _replaced(method: Callable[..., Any]) -> Callable[..., Any]:
    """What an op caller of this module replaced; any other function itself."""
    return getattr(method, "__dict__", {}).get("replaced_method", method)


def _run_selection(
    module_name: str,
    norm_class: str,
    hidden_states: torch.Tensor,
    q: torch.Tensor,
    raw_keys: torch.Tensor,
    full_cos: torch.Tensor,
    full_sin: torch.Tensor,
    attention_mask: torch.Tensor,
    key_norm_weight: torch.Tensor,
    key_norm_eps: float,
    token_budget: int,
    compress_ratio: int,
    batched: bool = False,
) -> torch.Tensor:
    """The class's token selection, run eagerly on a stand-in indexer that holds the fields it reads; with
    ``batched``, ``qsa_batched.select_tokens_batched`` where the mask allows it."""
    module = importlib.import_module(module_name)
    head_dim = q.shape[-1]
    key_norm = getattr(module, norm_class)(head_dim, eps=key_norm_eps)
    key_norm.weight = nn.Parameter(key_norm_weight, requires_grad=False)
    rope = getattr(module, "apply_rotary_pos_emb", None)
    if batched and rope is not None:
        visible = (attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0)[:, 0]
        args = (q, raw_keys, full_cos, full_sin, visible, token_budget, compress_ratio, key_norm, rope)
        if (mask := select_tokens_batched(*args)) is not None:
            return mask
    indexer = SimpleNamespace(
        token_budget=token_budget,
        compress_ratio=compress_ratio,
        block_topk=token_budget // compress_ratio,
        index_head_dim=head_dim,
        k_layernorm=key_norm,
    )
    method = _replaced(getattr(module, CLASS_NAME).__dict__[METHOD_NAME])
    mask = method(indexer, hidden_states, q, raw_keys, full_cos, full_sin, attention_mask)
    expected = _mask_shape(hidden_states, attention_mask)
    if tuple(mask.shape) != expected or mask.dtype != torch.bool:
        # Inductor plans buffers from the fake implementation: a selection of another shape must fail here.
        raise RuntimeError(
            f"hcpasses::qsa_select_tokens: the selection is {(tuple(mask.shape), mask.dtype)}, expected {expected} bool"
        )
    return mask.contiguous()


def _mask_shape(hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> tuple[int, ...]:
    batch, queries = hidden_states.shape[:2]
    return (batch, 1, queries, attention_mask.shape[-1])


# cudagraph_unsafe (torch >= 2.9): the body syncs with the host (a `nonzero` per query), which a CUDA-graph capture
# cannot hold; Inductor then leaves a graph holding the op uncaptured (or, with graph partitions, captures around it).
qsa_select_tokens = torch.library.custom_op(
    "hcpasses::qsa_select_tokens", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,)
)(_run_selection)


@qsa_select_tokens.register_fake
def _(module_name: str, norm_class: str, hidden_states: torch.Tensor, q: torch.Tensor, raw_keys: torch.Tensor,
      full_cos: torch.Tensor, full_sin: torch.Tensor, attention_mask: torch.Tensor, key_norm_weight: torch.Tensor,
      key_norm_eps: float, token_budget: int, compress_ratio: int, batched: bool = False) -> torch.Tensor:  # fmt: skip
    return hidden_states.new_empty(_mask_shape(hidden_states, attention_mask), dtype=torch.bool)


def _covered(indexer: nn.Module) -> bool:
    """Whether the indexer holds exactly the fields the stand-in rebuilds."""
    norm = getattr(indexer, "k_layernorm", None)
    fields = (getattr(indexer, name, None) for name in ("token_budget", "compress_ratio", "block_topk"))
    budget, ratio, topk = fields
    return (
        all(isinstance(value, int) for value in (budget, ratio, topk))
        and topk == budget // ratio
        and isinstance(getattr(norm, "weight", None), torch.Tensor)
        and isinstance(getattr(norm, "eps", None), float)
        and getattr(norm, "group_size", None) is None
    )


def _as_one_op(module_name: str, method: Callable[..., Any], batched: bool) -> Callable[..., Any]:
    method = _replaced(method)  # in a nested context, wrap what the outer one replaced

    def select_tokens(
        self: nn.Module,
        hidden_states: torch.Tensor,
        q: torch.Tensor,
        raw_keys: torch.Tensor,
        full_cos: torch.Tensor,
        full_sin: torch.Tensor,
        attention_mask: torch.Tensor,
        **kwargs: Any,
    ) -> torch.Tensor:
        if not _covered(self):
            return method(self, hidden_states, q, raw_keys, full_cos, full_sin, attention_mask, **kwargs)
        norm = self.k_layernorm
        return torch.ops.hcpasses.qsa_select_tokens(
            module_name, type(norm).__name__, hidden_states, q, raw_keys, full_cos, full_sin, attention_mask,
            norm.weight, norm.eps, self.token_budget, self.compress_ratio, batched,
        )  # fmt: skip

    select_tokens.replaced_method = method  # type: ignore[attr-defined]  # the op's body calls it
    return select_tokens


def _modules_defining_the_class() -> dict[str, type]:
    """The loaded transformers modules that define ``Qwen4ExpTextQSAIndexer``, by name, sorted."""
    found = {}
    for name, module in list(sys.modules.items()):
        cls = getattr(module, CLASS_NAME, None) if name.startswith("transformers.models.") else None
        if isinstance(cls, type) and cls.__module__ == name:
            found[name] = cls
    return dict(sorted(found.items()))


def _warn_unpatched(names: list[str]) -> None:
    if names:
        import transformers

        logger.warning(
            "hcpasses: %s.%s has no %s (transformers %s; the method exists from 5.25): its QSA token selection "
            "stays inside forward, where Dynamo breaks the graph at every query position",
            ", ".join(names), CLASS_NAME, METHOD_NAME, transformers.__version__,
        )  # fmt: skip


@contextlib.contextmanager
def qsa_selection_as_one_op(batched: bool = False) -> Iterator[list[str]]:
    """While open, the loaded transformers modules' QSA token selection is ``hcpasses::qsa_select_tokens``;
    ``batched``: all queries at once where the mask allows (``qsa_batched``: opt-in, ties may break otherwise).

    Yields the names of the modules whose class it patched (a class without the method: a warning names it).
    Dynamo reads the method when it traces (first call, recompiles): keep the compiled model's calls inside the
    context. Restored on exit, also when the block raises.
    """
    found = _modules_defining_the_class()
    _warn_unpatched([name for name, cls in found.items() if METHOD_NAME not in cls.__dict__])
    names = [name for name, cls in found.items() if METHOD_NAME in cls.__dict__]
    classes = [found[name] for name in names]
    saved = [cls.__dict__[METHOD_NAME] for cls in classes]
    try:
        for name, cls, method in zip(names, classes, saved, strict=True):
            setattr(cls, METHOD_NAME, _as_one_op(name, method, batched))
        yield names
    finally:
        for cls, method in zip(classes, saved, strict=True):
            setattr(cls, METHOD_NAME, method)
