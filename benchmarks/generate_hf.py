"""``model.generate()`` at real size with a forward compiled by the hcpasses backend, on one GPU (issue #27 item 6).

    PYTHONPATH=. python benchmarks/generate_hf.py --out benchmarks/results/generate_hf_h200.json      # GPU
    python benchmarks/generate_hf.py --cpu-smoke --out /tmp/smoke.json     # tiny model, CPU: the plumbing

What a transformers user does: shard the model for its rank (``hcpasses.hf.shard_for_tp``), compile
``model.forward`` with the backend, call ``model.generate(prompt, max_new_tokens=K, do_sample=False)`` inside
``hcpasses.hf.eager_kernels_under_compile()``. ``--model deepseek_v4`` (default) or ``qwen4_exp``: GatedDeltaNet
layers with PLE in the second (the first of two), then its indexed-attention layer (a GatedDeltaNet-only cut cannot
generate with a cache in transformers; the QSA token selection runs as one op inside the context, transformers'
loop over the query positions, so a prompt of P tokens runs P iterations of it per prefill). Where tp exceeds
qwen4_exp's KV heads each rank keeps a copy of its KV head (``prefill_hf.replicate_kv_heads``). Cases, each from a
fresh Dynamo state:

- ``tp 1``: eager, then the compiled forward with ``hcpasses.backend()`` and with ``cudagraphs=True``: the greedy
  tokens must equal eager's (``tokens_equal``); nothing to shard (one rank).
- ``tp N`` (simulated, ``simulated_tp.py``; rank 0): the compiled forward with ``sp_min_tokens`` below the prompt,
  ``cudagraphs`` off and on. The prompt's prefill must be sharded and no decode step (T = 1) may be; every graph
  compiled is listed with its variant and its ``sp_rewrite`` status. Greedy tokens are recorded, not compared: the
  stand-in collectives give one rank's partial sums as the sums, so eager and compiled runs see other values than a
  real TP job (and than each other: SP's reduce-scatter stand-in keeps one block of the rows where eager's
  all-reduce stand-in keeps all of them).

``--variants`` picks the compiled variants (default both; eager always runs at tp 1, its tokens are the reference),
so that a device call with little time can run the one it needs.

Per run: the wall seconds of the whole ``generate`` (first call: compiles included, with each forward's ms;
``--repeats`` more calls: the median), the prefill's and the decode steps' wall ms in the last repeat (a wrapper
of ``model.forward`` times each call, CUDA synchronised; none without repeats), the token count of each forward,
the graphs compiled (Dynamo's ``unique_graphs``), Inductor's cudagraph skips (``counters``), and the hcpasses
reports of every graph. With ``cudagraphs=True`` Inductor's CUDA-graph trees warm each graph up on its first call,
record it on the second and replay it from the third: the first repeat times recordings, so ``--repeats`` must be
at least 2 for the decode steps to be replays.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from prefill_hf import guarded, replicate_kv_heads, sync
from simulated_tp import simulated_tp

import hcpasses
from hcpasses.hf import eager_kernels_under_compile, shard_for_tp
from hcpasses.testing import hf_models

SMOKE_PROMPT, GPU_PROMPT = 16, 4096
MODELS = ("deepseek_v4", "qwen4_exp")
LAYERS = {"deepseek_v4": (1, 2), "qwen4_exp": (2, 4)}  # (smoke, GPU) defaults; qwen4_exp: the real 4-layer pattern


def build(name: str, smoke: bool, layers: int, device: torch.device) -> torch.nn.Module:
    if name == "qwen4_exp":
        # the indexed-attention layer last, as full_attention_interval = 4 places it; PLE on a GatedDeltaNet layer
        cut = {
            "layer_types": ["linear_attention"] * (layers - 1) + ["indexed_attention"],
            "ple_layer_ids": [min(2, layers - 1)],
        }
        if smoke:
            return hf_models.tiny_qwen4_exp(num_hidden_layers=layers, **cut).eval()
        return hf_models.real_qwen4_exp(layers, torch.bfloat16, device, **cut).eval()
    if smoke:
        tiny = hf_models.DEEPSEEK_V4_TINY
        cut = {key: tiny[key][:layers] for key in ("layer_types", "mlp_layer_types")}
        return hf_models.tiny_deepseek_v4(num_hidden_layers=layers, **cut).eval()
    return hf_models.real_deepseek_v4(num_layers=layers, dtype=torch.bfloat16, device=device).eval()


@contextlib.contextmanager
def timed_forwards(model: torch.nn.Module, device: torch.device) -> Iterator[list[tuple[int, float]]]:
    """(tokens, wall ms) of every call of ``model.forward`` while inside: prefill first, then the decode steps."""
    calls: list[tuple[int, float]] = []
    forward = model.forward

    def timed(*args: Any, **kwargs: Any) -> Any:
        ids = kwargs.get("input_ids", args[0] if args else None)
        sync(device)
        began = time.perf_counter()
        out = forward(*args, **kwargs)
        sync(device)
        calls.append((int(ids.shape[-1]) if ids is not None else -1, (time.perf_counter() - began) * 1e3))
        return out

    model.forward = timed
    try:
        yield calls
    finally:
        model.forward = forward


def generate(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, use_cache=True)


def run_generate(
    model: torch.nn.Module, prompt: torch.Tensor, args: argparse.Namespace, backend: Any | None
) -> dict[str, Any]:
    """One variant: eager (``backend`` None) or ``model.forward`` compiled with ``backend``."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager_forward = model.forward
    if backend is not None:
        model.forward = torch.compile(eager_forward, backend=backend)
    device = prompt.device
    try:
        with timed_forwards(model, device) as calls:
            began = time.perf_counter()
            tokens = generate(model, prompt, args.new_tokens)
            sync(device)
            first_s = time.perf_counter() - began
            first_calls = list(calls)
            repeat_s = []
            for _ in range(args.repeats):
                calls.clear()
                began = time.perf_counter()
                generate(model, prompt, args.new_tokens)
                sync(device)
                repeat_s.append(time.perf_counter() - began)
    finally:
        model.forward = eager_forward
    timed = calls if repeat_s else []  # the last repeat's forwards; none without repeats (compiles are in the first)
    decode = [ms for tokens_in, ms in timed if tokens_in == 1]
    row: dict[str, Any] = {
        "tokens": tokens[0, prompt.shape[-1] :].tolist(),
        "first_generate_s": round(first_s, 3),
        "first_forward_ms": [round(ms, 1) for _, ms in first_calls],
        "generate_s": round(statistics.median(repeat_s), 4) if repeat_s else None,
        "prefill_ms": round(timed[0][1], 3) if timed else None,
        "decode_ms": round(statistics.median(decode), 3) if decode else None,
        "forward_calls": [tokens_in for tokens_in, _ in first_calls],
        "graphs_compiled": torch._dynamo.utils.counters["stats"]["unique_graphs"],
        "cudagraph_skips": dict(torch._dynamo.utils.counters["inductor"]).get("cudagraph_skips", 0),
    }
    if backend is not None:
        row["graphs"] = [
            {"variant": r.variant, "sp_rewrite": r.record("sp_rewrite").status, "applied": r.applied}
            for r in backend.reports
        ]
        row["reports"] = [str(r) for r in backend.reports]
    return row


def sp_verdict(row: dict[str, Any]) -> dict[str, bool]:
    """The prompt's prefill sharded (its graph's ``sp_rewrite`` applied), and no graph sharded after it."""
    graphs = row.get("graphs", [])
    return {
        "prefill_sharded": bool(graphs) and graphs[0]["sp_rewrite"] == "applied",
        "decode_unsharded": all(g["sp_rewrite"] != "applied" for g in graphs[1:]),
    }


VARIANTS = ("hcpasses", "hcpasses_cudagraphs")  # the backend as it is, and with cudagraphs=True (CUDA only)


def run_case(tp: int, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    with simulated_tp(tp, 0):
        model = build(args.model, args.cpu_smoke, args.layers, device)
        if tp > 1:
            replicate_kv_heads(model, tp)
            model = shard_for_tp(model, 0, tp)
        vocab = model.config.vocab_size
        prompt = torch.randint(vocab, (1, args.prompt), generator=torch.Generator().manual_seed(7)).to(device)
        case: dict[str, Any] = {"tp": tp, "prompt": args.prompt, "new_tokens": args.new_tokens}
        if tp == 1:
            case["eager"] = run_generate(model, prompt, args, None)
            progress(case, "eager")
        for name in args.variants:
            flags = {"cudagraphs": device.type == "cuda"} if name == "hcpasses_cudagraphs" else {}
            backend = hcpasses.backend(sp_min_tokens=max(2, args.prompt // 2), **flags)
            # per variant: a failure of one (a CUDA-graph error) keeps the other's row
            row = guarded(functools.partial(run_generate, model, prompt, args, backend))
            if "error" not in row:
                row |= {"tokens_equal": row["tokens"] == case["eager"]["tokens"]} if tp == 1 else sp_verdict(row)
            case[name] = row
            progress(case, name)
        del model
        torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return case


def progress(case: dict[str, Any], name: str) -> None:
    """One line per finished variant, printed at once: a run a time limit ends still shows how far it got."""
    row = case[name]
    seconds = row.get("first_generate_s", "?")
    print(f"tp {case['tp']} {name}: {row.get('error', 'done')[:200]} (first generate {seconds} s)", flush=True)


def summary(case: dict[str, Any]) -> str:
    parts = [f"tp {case['tp']}"]
    for name in ("eager", *VARIANTS):
        row = case.get(name)
        if row is None:
            continue
        if "error" in row:
            parts.append(f"{name}: {row['error'][:300]}")
            continue
        checks = {k: row[k] for k in ("tokens_equal", "prefill_sharded", "decode_unsharded") if k in row}
        parts.append(
            f"{name}: prefill {row['prefill_ms']} ms, decode {row['decode_ms']} ms/token, "
            f"{row['graphs_compiled']} graphs {checks}"
        )
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cpu-smoke", action="store_true", help="the tiny model on CPU: the plumbing only")
    parser.add_argument("--tp", default=None, help="simulated TP sizes (default 1,8; smoke 1,2)")
    parser.add_argument("--prompt", type=int, default=None, help=f"prompt tokens (default {GPU_PROMPT})")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--model", choices=MODELS, default=MODELS[0])
    parser.add_argument("--layers", type=int, default=None, help=f"decoder layers (default, smoke and GPU: {LAYERS})")
    parser.add_argument(
        "--repeats", type=int, default=2, help="generate calls after the first (>= 2 to time replayed CUDA graphs)"
    )
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"compiled variants, of {', '.join(VARIANTS)}")
    parser.add_argument(
        "--qsa-batched",
        action="store_true",
        help="qwen4_exp's QSA selection for all queries at once, in eager's reference too (opt-in; README)",
    )
    args = parser.parse_args(argv)
    args.variants = args.variants.split(",")
    if not set(args.variants) <= set(VARIANTS):
        parser.error(f"--variants {','.join(args.variants)}: choose among {', '.join(VARIANTS)}")
    smoke = args.cpu_smoke
    args.prompt = args.prompt or (SMOKE_PROMPT if smoke else GPU_PROMPT)
    args.layers = args.layers or LAYERS[args.model][0 if smoke else 1]
    if args.model == "qwen4_exp" and args.layers < 2:
        parser.error("--layers: qwen4_exp needs 2 or more (a GatedDeltaNet layer and the indexed-attention layer)")
    tps = [int(t) for t in (args.tp or ("1,2" if smoke else "1,8")).split(",")]
    device = torch.device("cpu" if smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("needs CUDA (or --cpu-smoke)")
    result: dict[str, Any] = {
        "model": args.model,
        "layers": args.layers,
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke)",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "qsa_batched": args.qsa_batched,
        "method": __doc__,
        "cases": [],
    }
    with eager_kernels_under_compile(qsa_batched=args.qsa_batched):
        for tp in tps:
            result["cases"].append({"tp": tp, **guarded(lambda tp=tp: run_case(tp, args, device))})
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1, default=str))  # kept should a time limit end the run
            print(summary(result["cases"][-1]) if "error" not in result["cases"][-1] else result["cases"][-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
