"""``model.generate`` with a forward compiled by the hcpasses backend, 2 gloo ranks (issue #27 item 6).

A transformers user shards the model, compiles ``model.forward`` and calls ``generate``: the prompt's prefill
(T = 16 tokens, threshold 8) is sharded by SP, no decode step (T = 1) is, and the greedy tokens are eager's.

deepseek_v4 with one layer; qwen4_exp with a GatedDeltaNet layer and its indexed-attention layer (the one-layer
qwen4_exp, GatedDeltaNet only, cannot generate with a cache in transformers 5.24: ``get_seq_length`` raises, the
cache holds no attention layer). The QSA indexer's token selection runs as one op inside
``eager_kernels_under_compile()`` (without it Dynamo breaks the graph at every query position: over 15 minutes on
CPU). DeepSeek-V4's decode recompiles while its cache's compressor buffers grow (sizes 1, 2, 3 ...: Dynamo's
recompile limit bounds them, not hcpasses), so the number of decode graphs is reported, not asserted.
"""

from __future__ import annotations

import pytest
import torch
from hf_cases import FAMILIES, ONE_LAYER, SEQ, token_ids

NEW_TOKENS = 4
SP_MIN_TOKENS = SEQ // 2
# the smallest model of each family that generates with a cache, and the HC blocks its prefill shards (each
# layer's two and the final mixer or head)
GENERATING = {
    "deepseek_v4": (ONE_LAYER["deepseek_v4"], 3),
    "qwen4_exp": (
        {"num_hidden_layers": 2, "layer_types": ["linear_attention", "indexed_attention"], "ple_layer_ids": [1]},
        5,
    ),
}


def generate(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        # use_cache: the tiny configs turn the cache off (for one-call tests); generate then recomputes the prefix
        return model.generate(token_ids(1, seed=7), max_new_tokens=NEW_TOKENS, do_sample=False, use_cache=True)


def generate_rank(rank: int, tp: int, family: str) -> dict[str, object]:
    """One gloo rank: the tiny model sharded for this rank, ``forward`` compiled, greedy generation."""
    import hcpasses
    from hcpasses.hf import eager_kernels_under_compile, shard_for_tp

    model = shard_for_tp(FAMILIES[family](**GENERATING[family][0]), rank, tp)
    backend = hcpasses.backend(sp_min_tokens=SP_MIN_TOKENS)
    model.forward = torch.compile(model.forward, backend=backend)
    with eager_kernels_under_compile():
        tokens = generate(model)
    return {
        "tokens": tokens,
        "sp": [(r.variant, r.record("sp_rewrite").status, r.record("sp_rewrite").applied) for r in backend.reports],
        "calls": [dispatch.calls for dispatch in backend.dispatchers],
        "reports": [str(report) for report in backend.reports],
    }


@pytest.mark.thorough  # processes over gloo: CI, not the quick local run
@pytest.mark.parametrize("family", sorted(GENERATING))
def test_generate_shards_the_prefill_not_the_decode_and_matches_eager(family: str) -> None:
    from hcpasses.testing.multiproc import run_ranks

    config, blocks = GENERATING[family]
    expected = generate(FAMILIES[family](**config))
    assert expected.shape == (1, SEQ + NEW_TOKENS)
    for result in run_ranks(generate_rank, 2, family, timeout_s=900):
        assert torch.equal(result["tokens"], expected), result["reports"]
        prefill, *decode = result["sp"]
        assert prefill == ("only", "applied", blocks), result["reports"][0]  # one static graph, sharded
        assert decode and all(step == ("only", "unchanged", 0) for step in decode), result["reports"]
        assert all(f"T=1 < sp_min_tokens={SP_MIN_TOKENS}" in report for report in result["reports"][1:])
        assert result["calls"] == [], result["calls"]  # no graph with a symbolic T: nothing to dispatch
