#!/usr/bin/env bash
# One device call's worth of GPU checks (H200 or H100, torch 2.11): the GPU test files, then the prefill runs whose numbers
# docs/BENCHMARKS.md waits for. Run from the repository root on the device machine with `.whl` carried
# (DESIGN §10 and docs/BENCHMARKS.md: transformers 5.25, huggingface_hub 2.5, httpx2, httpcore2, truststore,
# flash-linear-attention, fla-core, einops wheels; `pip download --no-deps` each), results under $OUT:
#
#     bash benchmarks/gpu_session.sh tests      # GPU test files, then the fla test alone (about 220 s)
#     bash benchmarks/gpu_session.sh prefill    # deepseek_v4 and qwen4_exp bf16 tp 8, T = 16384, three variants each
#     bash benchmarks/gpu_session.sh scans      # blocked_scans: the scan alone (a copy, then transformers' n-gram
#                                               # module), then qwen4_exp bf16 tp 8 per kernel
#     bash benchmarks/gpu_session.sh scans-quick  # blocked_scans' GPU tests, the copy at two lengths, the module once
#     bash benchmarks/gpu_session.sh generate   # generate() at real size: deepseek_v4 tp 8 (simulated), then tp 1
#                                               # (GENERATE_TP=1 or 8: one of them, for a short device call;
#                                               # GENERATE_MODEL=qwen4_exp: qwen4_exp's 4-layer pattern)
#     bash benchmarks/gpu_session.sh grid       # issue #27's prefill_hf cells not yet measured (prefill_hf_grid.py
#                                               # --missing-commands), one run each, until GRID_BUDGET_S (default
#                                               # 520) seconds are spent; JSONs, pngs and logs in $OUT/grid.tgz
#                                               # (GRID_ONLY=<regex>: only the runs whose tag matches it). The
#                                               # missing cells are read from the carried benchmarks/results: put
#                                               # a call's JSONs there before the next grid call, or it measures
#                                               # them again (2026-12-07: 160 s of device time spent so)
#     bash benchmarks/gpu_session.sh bench      # the benchmark model's three variants at simulated tp 2, 4, 8,
#                                               # T = 16384 and 65536, one process per point (BENCH_TP=8 and/or
#                                               # BENCH_POINTS=1024x16, BENCH_VARIANTS=...: fewer, for a short call;
#                                               # BENCH_FP8=1: FP8 input projections; BENCH_KERNELS=1: kernels by kind)
#     bash benchmarks/gpu_session.sh host       # delta_rule_host.py: one delta rule call's host and GPU time, level by
#                                               # level (hcpasses op, transformers, fla, fla's kernels), tp 1 and 8
#
# Each step has its own timeout so that one stuck step leaves the others' logs; the logs land in $OUT.
set -uo pipefail
out=${OUT:?set OUT to the folder the results go to}
case "${1:-}" in tests | prefill | scans | scans-quick | generate | grid | bench | host) ;; *)
    echo "usage: bash benchmarks/gpu_session.sh tests|prefill|scans|scans-quick|generate|grid|bench|host" >&2
    exit 2
    ;;
esac
install="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade"
# transformers 5.25 (what CI installs; hcpasses::qsa_select_tokens wraps its _select_tokens, which 5.24 lacks) wants
# huggingface_hub >= 2.4, which wants httpx2, httpcore2 and truststore; the machine has hub 1.33. A warm machine keeps
# /tmp/site between calls: reinstall when the carried wheels differ from those it holds (2026-12-07: a call meant
# for 5.25 ran on the 5.24 installed by the call before)
carried=$(ls .whl | md5sum | cut -c1-12)
if [ ! -f "/tmp/site/.carried-$carried" ]; then
    rm -rf /tmp/site /tmp/site_fla
    $install --target /tmp/site .whl/transformers*.whl .whl/huggingface_hub*.whl .whl/httpx2*.whl \
        .whl/httpcore2*.whl .whl/truststore*.whl && touch "/tmp/site/.carried-$carried"
fi
[ -d /tmp/site_fla ] || $install --target /tmp/site_fla .whl/fla_core*.whl .whl/flash_linear*.whl .whl/einops*.whl
PYTHONPATH=/tmp/site python3 -c "import transformers; print('transformers', transformers.__version__)"
export PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
# the result files name the GPU the call got (an H100 may serve a call for an H200)
gpu=$(python3 -c "import torch; print('h200' if 'H200' in torch.cuda.get_device_name() else 'h100')")
git log --oneline -1 2>/dev/null || true

case "${1:-}" in
tests)
    # TESTS_TIMEOUT_S, FLA_TIMEOUT_S: shorter bounds when little device time is left (a cut run's log does not name
    # the test it stopped in)
    PYTHONPATH=/tmp/site:.:tests timeout ${TESTS_TIMEOUT_S:-420} python3 -m pytest -q -p no:cacheprovider -n 8 -rfEs \
        tests/test_gpu.py tests/test_kernels.py tests/test_quant_evaluation.py tests/real_models/test_compile.py \
        tests/real_models/test_sp_real.py tests/real_models/test_export_check.py \
        tests/real_models/test_delta_rule_op.py tests/real_models/test_qsa_selection_op.py \
        tests/real_models/test_handwritten_sp_hf.py tests/test_sp_prologue.py tests/real_models/test_sp_prologue_real.py \
        tests/test_sp_kept_rows.py tests/test_lazy_variants.py tests/test_blocked_scans.py tests/test_cudagraph_outputs.py -k "not interpreter" 2>&1 | tee "$out/gpu_tests.log" | tail -15
    PYTHONPATH=/tmp/site_fla:/tmp/site:.:tests timeout ${FLA_TIMEOUT_S:-120} python3 -m pytest -q -p no:cacheprovider -rfEs \
        tests/real_models/test_delta_rule_op.py -k flash_linear 2>&1 | tee "$out/fla.log" | tail -3
    ;;
prefill)
    # re-measures after 1333912 (deepseek_v4's input norms on the shards) and 4ea8d31 (the start's shard a slice)
    bench="python3 benchmarks/prefill_hf.py --tokens 16384 --warmup 1 --repeats 5 --out $out"
    PYTHONPATH=/tmp/site_fla:/tmp/site:.:benchmarks timeout 200 $bench --models deepseek_v4 --layers 2 --dtypes bf16 \
        --tp 8 --variants sp_off,hcpasses_sp,handwritten_sp --tag ds2_prologue_bf16_tp8_$gpu 2>&1 | tee "$out/ds.log" \
        | grep -E "^(deep|case)|vs hand|compute gain"
    PYTHONPATH=/tmp/site_fla:/tmp/site:.:benchmarks timeout 220 $bench --models qwen4_exp --layers 3 --dtypes bf16 \
        --tp 8 --variants sp_off,hcpasses_sp,handwritten_sp --tag q3_slice_bf16_tp8_$gpu 2>&1 | tee "$out/q.log" \
        | grep -E "^(qwen|case)|vs hand|compute gain"
    ;;
scans)
    PYTHONPATH=/tmp/site:. timeout 150 python3 benchmarks/blocked_scans.py --out "$out/blocked_scans_$gpu.json" 2>&1 \
        | tee "$out/scans.log" | grep -E "^\["
    PYTHONPATH=/tmp/site:. timeout 120 python3 benchmarks/blocked_scans.py --source ngram --cases 1x16384,1x65536 \
        --out "$out/blocked_scans_ngram_$gpu.json" 2>&1 | tee "$out/scans_ngram.log" | grep -E "^\["
    bench="python3 benchmarks/prefill_hf.py --tokens 16384 --warmup 1 --repeats 10 --out $out"
    PYTHONPATH=/tmp/site_fla:/tmp/site:.:benchmarks timeout 300 $bench --models qwen4_exp --layers 3 --dtypes bf16 \
        --tp 8 --variants handwritten_sp,hcpasses_sp --tag q3_bf16_tp8_scans_$gpu 2>&1 | tee "$out/q.log" \
        | grep -E "^(qwen|case)"
    ;;
scans-quick)
    PYTHONPATH=/tmp/site:.:tests timeout 120 python3 -m pytest -q -p no:cacheprovider -rfEs tests/test_blocked_scans.py \
        -k "cuda or inductor_may_split" 2>&1 | tee "$out/scans_tests.log" | tail -6
    PYTHONPATH=/tmp/site:. timeout 100 python3 benchmarks/blocked_scans.py --cases 1x16384,1x65536,8x2048 --repeats 10 \
        --warmup 2 --out "$out/blocked_scans_$gpu.json" 2>&1 | tee "$out/scans.log" | grep -E "^\["
    # transformers' own n-gram module: which level of its blocked scan still runs in ATen in the real model
    PYTHONPATH=/tmp/site:. timeout 120 python3 benchmarks/blocked_scans.py --source ngram --cases 1x16384 --repeats 10 \
        --warmup 2 --out "$out/blocked_scans_ngram_$gpu.json" 2>&1 | tee "$out/scans_ngram.log" | grep -E "^\["
    ;;
generate)
    # 3 repeats: a CUDA-graph tree warms a graph up on its first call, records it on the second and replays it from
    # the third; with 1 repeat the decode steps timed are the recordings (12.7 ms a step at tp 8, 1.7 replayed)
    # GENERATE_MODEL=qwen4_exp: its 4-layer pattern (not yet run on a GPU; the QSA selection loops over the prompt)
    model=${GENERATE_MODEL:-deepseek_v4}
    for tp in ${GENERATE_TP:-8 1}; do  # GENERATE_TP=1: one tp per device call when time is short
        PYTHONPATH=/tmp/site_fla:/tmp/site:.:benchmarks timeout 290 python3 benchmarks/generate_hf.py --model $model \
            --tp $tp --repeats 3 --new-tokens 4 --out "$out/generate_hf_${model}_tp${tp}_$gpu.json" 2>&1 \
            | tee "$out/generate_${model}_tp$tp.log" | tail -2
    done
    ;;
grid)
    # the device call returns at most 8 files: every run's JSON, png and log go into one archive
    mkdir -p "$out/grid"
    budget=${GRID_BUDGET_S:-520}
    began=$SECONDS
    python3 benchmarks/prefill_hf_grid.py --missing-commands | grep -E -- "--tag .*(${GRID_ONLY:-})" \
        > "$out/grid/commands.txt"
    while read -r args; do
        left=$((budget - (SECONDS - began)))
        if [ "$left" -lt 90 ]; then echo "grid: ${left}s left, stopping before: $args"; break; fi
        tag=${args##*--tag }
        echo "grid: $args (timeout ${left}s)"
        PYTHONPATH=/tmp/site_fla:/tmp/site:.:benchmarks timeout "$left" python3 benchmarks/prefill_hf.py $args \
            --tag "${tag}_$gpu" --out "$out/grid" > "$out/grid/$tag.log" 2>&1
        echo "grid: rc $? after $((SECONDS - began))s"; grep -E "^(qwen|deep|case)|vs hand|compute gain" "$out/grid/$tag.log"
    done < "$out/grid/commands.txt"
    tar czf "$out/grid.tgz" -C "$out" grid && rm -rf "$out/grid"
    ;;
bench)
    # issue #27's first goal: hcpasses >= the hand-written SP in per-rank compute at tp 2, 4, 8 for T >= 16384
    # one process per point: a second point in the same process can recompile one variant and not another
    # (kernels tuned for the other T), which confounds the comparison; results go to $out/<point>/
    for tp in ${BENCH_TP:-2 4 8}; do
        for point in ${BENCH_POINTS:-1024x16 1024x64}; do
            PYTHONPATH=.:benchmarks timeout 300 python3 benchmarks/prefill_sp.py --simulate --tp $tp \
                --points $point --variants ${BENCH_VARIANTS:-sp_off,hcpasses_sp,handwritten_sp} --layers 4 --dynamic \
                ${BENCH_FP8:+--fp8} ${BENCH_KERNELS:+--kernels} --out "$out/$point" 2>&1 | tee "$out/bench_tp${tp}_$point${BENCH_FP8:+_fp8}.log" | tail -6
        done
    done
    ;;
host)
    PYTHONPATH=/tmp/site_fla:/tmp/site:.:benchmarks timeout 200 python3 benchmarks/delta_rule_host.py --tp 1,8 \
        --out "$out/delta_rule_host_$gpu.json" 2>&1 | tee "$out/host.log" | grep -E "^tp "
    ;;
esac
