"""Turn a plain torch pattern function into an Inductor pattern-matcher pattern.

We use Inductor's own pattern matcher (``fwd_only`` tracing, ``fx_to_pattern``, ``PatternMatcherPass``)
rather than a hand-written graph walker. Two adjustments to what ``register_replacement`` would do:

- Literal ints, floats and dtypes stay part of the pattern (``register_replacement`` ignores them):
  a quant that divides by 447, a cast to e5m2 or a sum instead of a mean must not match. Only lists
  (reshape sizes, reduction dims, which carry T, n and S) are wildcards; ``check_streams`` and
  ``check_reduction`` verify them on each match.
- ``aten.view`` in the traced pattern becomes ``aten.reshape``: Inductor converts every view to a
  reshape before the post-grad passes run, so that is what the graph holds.

``gen_pattern``-style helpers are internal to Inductor; tests/test_gated_mean_quant.py pins the
behaviour we rely on (a pattern traced here matches the graphs Inductor hands us on 2.11 and 2.13).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._inductor.pattern_matcher import Match, PatternExpr, fwd_only, fx_to_pattern
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.fx.immutable_collections import immutable_list

aten = torch.ops.aten


def trace_pattern(
    search_fn: Callable[..., Any],
    example_inputs: Sequence[torch.Tensor],
    argnames: Sequence[str],
    scalars: dict[str, int | float] | None = None,
) -> PatternExpr:
    """Trace ``search_fn(*example_inputs)`` into a pattern whose inputs are named ``argnames``.

    ``scalars`` maps a name to a literal the trace contains (an unusual value picked for tracing);
    that literal becomes a wildcard bound under the name, e.g. ATOM's ``/ n``.
    """
    gm = fwd_only(search_fn, list(example_inputs))
    for node in gm.graph.nodes:
        if node.target is aten.view.default:
            node.target = aten.reshape.default
    gm.recompile()
    # FX hands node args over as immutable_list, so both list types must be named to make lists wildcards.
    ignore = (list, immutable_list, torch.device)
    return fx_to_pattern(gm, ignore_types=ignore, argnames=argnames, scalar_workaround=scalars)


def matched(match: Match, target: Any) -> list[fx.Node]:
    """The nodes of ``match`` that call ``target``, in graph order."""
    return [n for n in match.nodes if n.op == "call_function" and n.target is target]


def value_of(node: Any) -> Any:
    """The fake value of a graph node (``meta["val"]``); None for a literal or a node without one."""
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def static_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def split_streams(reshape: fx.Node) -> tuple[int, int] | None:
    """``(n, S)`` when ``reshape`` turns ``[..., n*S]`` into ``[..., n, S]`` (same leading dims, static n, S)."""
    source, sizes = reshape.args[0], reshape.args[1]
    val = value_of(source)
    if not isinstance(val, torch.Tensor) or not isinstance(sizes, (list, tuple)) or len(sizes) != val.dim() + 1:
        return None
    out = reshape.meta.get("val")
    n, hidden = static_int(sizes[-2]), static_int(sizes[-1])
    if n is None or hidden is None or not isinstance(out, torch.Tensor) or static_int(val.shape[-1]) != n * hidden:
        return None
    return (n, hidden) if same_sizes(out.shape[:-2], val.shape[:-1]) else None


def same_sizes(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Whether two shapes are provably equal (ints or SymInts)."""
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b, strict=True))


def reduces_dim(node: fx.Node, ndim: int, dim: int) -> bool:
    """Whether ``node`` (a reduction ``op(x, dims, ...)``) reduces exactly dim ``dim`` of an ``ndim``-D x."""
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if not isinstance(dims, (list, tuple)) or len(dims) != 1 or static_int(dims[0]) is None:
        return False
    return dims[0] % ndim == dim % ndim


def sub_dag(
    root: fx.Node,
    sources: Collection[fx.Node],
    inputs_of: Callable[[fx.Node], Iterable[fx.Node]],
    limit: int,
    stop: Collection[fx.Node] = (),
) -> frozenset[fx.Node] | str:
    """The nodes between ``sources`` and ``root`` (``root`` in, ``sources`` out), when every path up from ``root``
    ends in a source or a constant and each source is read; else why not. ``inputs_of`` says which inputs a node's
    values come from (the evaluations skip size operands), ``stop`` holds nodes the sub-DAG must not reach.
    Shared by the collapse and the quant found by evaluation: both run the sub-DAG on probes, so it must read
    nothing else."""
    names = " and ".join(source.name for source in sources)
    seen: set[fx.Node] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if node in seen or node in sources:
            continue
        if node.op not in ("call_function", "get_attr"):  # get_attr: a constant tensor
            return f"reads {node.name} ({node.op}) besides {names}"
        if node in stop:
            return f"reaches {node.name}, already taken"
        seen.add(node)
        if len(seen) > limit:
            return f"more than {limit} nodes between {names} and it"
        stack.extend(inputs_of(node))
    read = {i for node in seen for i in inputs_of(node)}
    unread = [source.name for source in sources if source not in read]
    return f"does not read {', '.join(unread)}" if unread else frozenset(seen)
