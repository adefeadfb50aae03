# The blocked_scans pass on the GPU in one short device call: its GPU tests, then the scan alone at two lengths.
# Run from the repository root on the device machine, results under $OUT (no wheels needed).
set -u
export PYTHONUNBUFFERED=1
python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
PYTHONPATH=.:tests timeout 120 python3 -m pytest -q -p no:cacheprovider -rfEs tests/test_blocked_scans.py -k "cuda or inductor_splits" 2>&1 | tail -6
PYTHONPATH=.:tests timeout 100 python3 benchmarks/blocked_scans.py --cases 1x16387,1x65539 --repeats 10 --warmup 2 --out "$OUT/blocked_scans_h200.json" 2>&1 | grep -E "^\[|Error|error" | tail -5
