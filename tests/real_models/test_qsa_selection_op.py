"""``hcpasses.hf.qsa_selection_op``: qwen4_exp's QSA token selection as one custom op under ``torch.compile``.

The op's selections are the method's, bit for bit, on the arguments a real forward passes it (captured from eager
forwards of the tiny model: one and two sequences, a sequence shorter than one compressed block, the bool mask of
sdpa and the float mask of eager attention); inside ``eager_kernels_under_compile()`` the whole tiny model is one
Dynamo graph with one op per indexed-attention layer, compiled or not equal to eager; what the op does not cover
goes to the method; the context restores the class on exit.
"""

from __future__ import annotations

import logging
import sys
import types
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import transformers
from hf_cases import FAMILIES, GraphRecorder, token_ids
from transformers.models.qwen4_exp import modeling_qwen4_exp

from hcpasses.hf import eager_kernels_under_compile, qsa_selection_as_one_op

MODULE = "transformers.models.qwen4_exp.modeling_qwen4_exp"
INDEXER = modeling_qwen4_exp.Qwen4ExpTextQSAIndexer
OP = torch.ops.hcpasses.qsa_select_tokens
# one GatedDeltaNet layer then the indexed-attention layer: the smallest model with both (and with a cache)
TWO_LAYERS = {"num_hidden_layers": 2, "layer_types": ["linear_attention", "indexed_attention"], "ple_layer_ids": []}
VERSION_FREE = "test_a_class_without_the_method_is_left_alone_with_a_warning"


@pytest.fixture(autouse=True)
def _needs_the_method(request: pytest.FixtureRequest) -> None:
    """The op wraps ``_select_tokens``, which transformers has from 5.25 (5.24 loops inside ``forward``; the GPU
    machine's tests ran on 5.24 until 2026-12-07): every test but the one about its absence needs it."""
    if request.node.originalname != VERSION_FREE and "_select_tokens" not in INDEXER.__dict__:
        pytest.skip(f"needs transformers >= 5.25 (Qwen4ExpTextQSAIndexer._select_tokens); {transformers.__version__}")


def captured_selections(
    ids: torch.Tensor, float_mask: bool = False, padding: torch.Tensor | None = None, **config: object
) -> list[tuple[torch.nn.Module, tuple]]:
    """``(indexer, args)`` of every call of the selection in one eager forward of the tiny model on ``ids`` (with
    the 2-D ``attention_mask`` ``padding``; ``config``: overrides of the tiny model's)."""
    model = FAMILIES["qwen4_exp"](**TWO_LAYERS, **config)
    original = INDEXER._select_tokens
    calls = []

    def spy(self: torch.nn.Module, *args: torch.Tensor, **kwargs: object) -> torch.Tensor:
        if float_mask:  # eager attention's additive mask: 0 where visible
            args = (*args[:-1], torch.zeros(args[-1].shape).masked_fill(~args[-1], torch.finfo(torch.float32).min))
        calls.append((self, args))
        return original(self, *args, **kwargs)

    with mock.patch.object(INDEXER, "_select_tokens", spy), torch.no_grad():
        model(ids, attention_mask=padding)
    return calls


def op_args(indexer: torch.nn.Module, args: tuple, batched: bool = False) -> tuple:
    norm = indexer.k_layernorm
    fields = (norm.weight, norm.eps, indexer.token_budget, indexer.compress_ratio, batched)
    return (MODULE, type(norm).__name__, *args, *fields)


@pytest.mark.parametrize(
    ("ids", "float_mask"),
    [
        (token_ids(1, seed=1), False),
        (token_ids(2, seed=2), False),  # two sequences: the method's outer loop
        (token_ids(1, seed=3)[:, :3], False),  # shorter than one block of 4: no block to score
        (token_ids(1, seed=4), True),
    ],
    ids=["one", "two", "short", "float-mask"],
)
def test_the_op_is_the_method_bit_for_bit_and_its_fake_agrees(ids: torch.Tensor, float_mask: bool) -> None:
    ((indexer, args),) = captured_selections(ids, float_mask)
    want = INDEXER._select_tokens(indexer, *args)
    got = OP(*op_args(indexer, args))
    assert got.dtype == torch.bool and got.is_contiguous()
    assert got.shape == (ids.shape[0], 1, ids.shape[1], args[-1].shape[-1])
    assert torch.equal(got, want)
    assert want.any() and not want.all()  # a selection, not everything or nothing
    torch.library.opcheck(OP, op_args(indexer, args), test_utils=("test_schema", "test_faketensor"))


def test_the_op_is_tagged_unsafe_for_cuda_graphs() -> None:
    """Its body syncs with the host at every query: a CUDA-graph capture of it would fail, so Inductor must skip (or
    partition around) a graph that holds it."""
    assert torch.Tag.cudagraph_unsafe in OP.default.tags


def test_inside_the_context_the_model_is_one_graph_with_one_op_per_indexed_layer() -> None:
    model = FAMILIES["qwen4_exp"]()  # 3 GatedDeltaNet layers (PLE in one) and the indexed-attention layer
    ids = token_ids(1, seed=5)
    with torch.no_grad():
        expected = model(ids).logits
    recorder = GraphRecorder()
    torch._dynamo.reset()
    with eager_kernels_under_compile() as patched, torch.no_grad():
        recorded = torch.compile(model, backend=recorder)(ids).logits
    assert patched["qsa_selection_op"] == [MODULE]
    assert len(recorder.graphs) == 1  # no break in the indexer (test_compile.py: one per query position without it)
    targets = [node.target for node in recorder.graphs[0].graph.nodes if node.op == "call_function"]
    assert targets.count(OP) == 1, targets
    assert torch.nonzero not in targets
    torch.testing.assert_close(recorded, expected, rtol=0, atol=0)


def test_inductor_compiles_the_op_as_an_extern_call() -> None:
    model = FAMILIES["qwen4_exp"](**TWO_LAYERS)
    ids = token_ids(1, seed=6)
    torch._dynamo.reset()
    with eager_kernels_under_compile(), torch.no_grad():
        expected = model(ids).logits
        actual = torch.compile(model, backend="inductor")(ids).logits
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)


def test_what_the_op_does_not_cover_goes_to_the_method() -> None:
    ((indexer, args),) = captured_selections(token_ids(1, seed=7))
    mask = INDEXER._select_tokens(indexer, *args)
    method = mock.Mock(return_value=mask)
    with mock.patch.object(INDEXER, "_select_tokens", method), qsa_selection_as_one_op():
        assert INDEXER._select_tokens is not method and INDEXER._select_tokens.replaced_method is method
        assert torch.equal(indexer._select_tokens(*args), mask)
        (called_on, *_), _ = method.call_args
        assert isinstance(called_on, SimpleNamespace)  # the op's stand-in, with the indexer's fields
        assert (called_on.token_budget, called_on.compress_ratio, called_on.block_topk) == (8, 4, 2)
        assert called_on.index_head_dim == 16 and torch.equal(called_on.k_layernorm.weight, indexer.k_layernorm.weight)
        indexer.block_topk = 3  # not budget // ratio: the stand-in would not be this indexer
        assert torch.equal(indexer._select_tokens(*args), mask)
        (called_on, *_), _ = method.call_args
        assert called_on is indexer and method.call_count == 2
        indexer.block_topk = 2
        indexer.k_layernorm.group_size = 4  # a grouped key norm: not rebuilt
        indexer._select_tokens(*args)
        assert method.call_args[0][0] is indexer and method.call_count == 3


def test_a_selection_of_another_shape_is_an_error() -> None:
    ((indexer, args),) = captured_selections(token_ids(1, seed=8))
    wrong = mock.Mock(return_value=torch.ones(1, 1, 16, 3, dtype=torch.bool))
    with mock.patch.object(INDEXER, "_select_tokens", wrong), qsa_selection_as_one_op():
        with pytest.raises(RuntimeError, match=r"the selection is .* expected \(1, 1, 16, 16\) bool"):
            indexer._select_tokens(*args)


def test_the_context_restores_the_class_on_exit_on_raise_and_when_nested() -> None:
    original = INDEXER.__dict__["_select_tokens"]
    with qsa_selection_as_one_op() as patched, eager_kernels_under_compile():
        assert patched == [MODULE]
        assert INDEXER.__dict__["_select_tokens"].replaced_method is original  # the inner wraps the method itself
    assert INDEXER.__dict__["_select_tokens"] is original
    with pytest.raises(KeyError), qsa_selection_as_one_op():
        raise KeyError("body")
    assert INDEXER.__dict__["_select_tokens"] is original


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the GPU machine)")
def test_on_cuda_the_model_compiles_as_one_graph_with_the_passes_and_matches_eager() -> None:
    import hcpasses

    model = FAMILIES["qwen4_exp"](**TWO_LAYERS).cuda()
    ids = token_ids(1, seed=9).cuda()
    backend = hcpasses.backend()
    torch._dynamo.reset()
    with eager_kernels_under_compile(), torch.no_grad():
        expected = model(ids).logits
        actual = torch.compile(model, backend=backend)(ids).logits
    assert len(backend.reports) == 1  # one graph: the selection did not break it
    assert all(record.status != "rolled_back" for record in backend.reports[0].passes), str(backend.reports[0])
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the GPU machine)")
def test_on_cuda_generate_with_cudagraphs_gives_eagers_tokens() -> None:
    """Decode steps hold the op (one query each): with ``cudagraphs=True`` they must run, uncaptured where the op is,
    not fail inside a capture."""
    import hcpasses

    model = FAMILIES["qwen4_exp"](**TWO_LAYERS).cuda()
    prompt = token_ids(1, seed=10).cuda()

    def generate() -> torch.Tensor:
        with torch.no_grad():
            return model.generate(prompt, max_new_tokens=4, do_sample=False, use_cache=True)

    expected = generate()
    eager_forward = model.forward
    torch._dynamo.reset()
    model.forward = torch.compile(eager_forward, backend=hcpasses.backend(cudagraphs=True))
    try:
        with eager_kernels_under_compile():
            tokens = [generate() for _ in range(3)]  # CUDA-graph trees record on the second call, replay on the third
    finally:
        model.forward = eager_forward
    assert all(torch.equal(t, expected) for t in tokens)


def test_a_class_without_the_method_is_left_alone_with_a_warning(monkeypatch, caplog) -> None:
    """A loaded transformers module whose indexer class has no ``_select_tokens`` (transformers 5.24): the context
    leaves that class as it is, yields only the modules it patched, and logs a warning naming the module, the
    method and the transformers version."""
    name = "transformers.models.qwen4_exp_old.modeling_qwen4_exp_old"
    old = types.ModuleType(name)
    old_class = type("Qwen4ExpTextQSAIndexer", (torch.nn.Module,), {"__module__": name})
    old.Qwen4ExpTextQSAIndexer = old_class
    monkeypatch.setitem(sys.modules, name, old)
    with caplog.at_level(logging.WARNING, logger="hcpasses"), qsa_selection_as_one_op() as patched:
        assert name not in patched and "_select_tokens" not in old_class.__dict__
        assert patched == ([MODULE] if "_select_tokens" in INDEXER.__dict__ else [])
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert name in warning and "_select_tokens" in warning and transformers.__version__ in warning, warning


SIXTEEN_HEADS = {"indexer_n_heads": 16}  # a score is exactly 0 (a tie) when every head's product is negative: 2^-16
LONG = 61  # 15 complete blocks of 4 and a tail of 1 for the last query; block_topk 2 of them


def left_padded(pad: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(128, (2, LONG), generator=torch.Generator().manual_seed(seed))
    padding = torch.ones(2, LONG, dtype=torch.long)
    padding[1, :pad] = 0  # the second sequence left-padded: its visible keys start at pad
    return ids, padding


@pytest.mark.parametrize(
    ("ids", "padding", "float_mask"),
    [
        (torch.randint(128, (1, LONG), generator=torch.Generator().manual_seed(21)), None, False),
        (torch.randint(128, (2, LONG), generator=torch.Generator().manual_seed(22)), None, True),
        (*left_padded(7, 23), False),
        (torch.randint(128, (1, 3), generator=torch.Generator().manual_seed(24)), None, False),  # no complete block
    ],
    ids=["one", "two-float-mask", "left-padded", "short"],
)
def test_the_batched_selection_is_the_methods_on_real_forwards(
    ids: torch.Tensor, padding: torch.Tensor | None, float_mask: bool
) -> None:
    """All queries at once (``batched=True``) select exactly the method's tokens on the arguments of eager forwards
    (random weights and ids, 16 indexer heads: no tie), padded sequences included (each sequence's own start)."""
    ((indexer, args),) = captured_selections(ids, float_mask, padding, **SIXTEEN_HEADS)
    want = INDEXER._select_tokens(indexer, *args)
    with mock.patch.object(INDEXER, "_select_tokens", side_effect=AssertionError("the loop ran")):
        got = OP(*op_args(indexer, args, batched=True))
    assert got.dtype == torch.bool and got.shape == want.shape
    assert torch.equal(got, want)
    assert want.any() and (ids.shape[1] < 4 or not want.all())
    torch.library.opcheck(OP, op_args(indexer, args, batched=True), test_utils=("test_schema", "test_faketensor"))


def test_a_visibility_that_is_not_one_run_per_sequence_goes_to_the_loop() -> None:
    """A query whose visible keys have a hole (or start elsewhere than its sequence's first key): the batched path
    declines (``shared_start_runs`` is None) and the op runs the method: its selection exactly."""
    from hcpasses.hf.qsa_batched import shared_start_runs

    ((indexer, args),) = captured_selections(torch.randint(128, (1, LONG)), **SIXTEEN_HEADS)
    holed = args[-1].clone()
    holed[0, 0, 40, 17] = False  # query 40 no longer sees key 17
    args = (*args[:-1], holed)
    assert shared_start_runs(holed[:, 0]) is None and shared_start_runs(captured_mask(LONG)) is not None
    want = INDEXER._select_tokens(indexer, *args)
    assert torch.equal(OP(*op_args(indexer, args, batched=True)), want)


def captured_mask(length: int) -> torch.Tensor:
    return torch.ones(length, length, dtype=torch.bool).tril()[None]


def test_ties_leave_the_count_of_blocks_and_the_tail_as_the_method_has_them() -> None:
    """q = 0: every block scores 0, all tied: which blocks ``topk`` picks is its implementation's choice, in the loop
    as batched; what must agree is how many (min(block_topk, complete blocks)), that they are complete blocks, and
    the tail."""
    ((indexer, args),) = captured_selections(torch.randint(128, (1, LONG)), **SIXTEEN_HEADS)
    args = (args[0], torch.zeros_like(args[1]), *args[2:])
    want = INDEXER._select_tokens(indexer, *args)[0, 0]
    got = OP(*op_args(indexer, args, batched=True))[0, 0]
    assert torch.equal(got.sum(-1), want.sum(-1))
    for query in range(LONG):
        complete = (query + 1) // 4
        assert torch.equal(got[query, complete * 4 :], want[query, complete * 4 :])  # the tail, and nothing after
        blocks = got[query, : complete * 4].view(-1, 4)
        assert (blocks.all(-1) | ~blocks.any(-1)).all()  # whole blocks only
        assert blocks.all(-1).sum() == min(2, complete)


def test_the_batched_selection_compiles_and_gives_eagers_logits() -> None:
    """Through ``eager_kernels_under_compile(qsa_batched=True)``: one graph, the op called with ``batched`` set,
    Inductor's logits equal to eager's (the method's selection) on a left-padded batch."""
    model = FAMILIES["qwen4_exp"](**TWO_LAYERS, **SIXTEEN_HEADS)
    ids, padding = left_padded(5, 31)
    with torch.no_grad():
        expected = model(ids, attention_mask=padding).logits
    recorder = GraphRecorder()
    torch._dynamo.reset()
    with eager_kernels_under_compile(qsa_batched=True), torch.no_grad():
        recorded = torch.compile(model, backend=recorder)(ids, attention_mask=padding).logits
        compiled = torch.compile(model, backend="inductor")(ids, attention_mask=padding).logits
    (graph,) = recorder.graphs
    (call,) = [node for node in graph.graph.nodes if node.target is OP]
    assert call.args[-1] is True
    torch.testing.assert_close(recorded, expected, rtol=0, atol=0)
    torch.testing.assert_close(compiled, expected, rtol=1e-4, atol=1e-5)
