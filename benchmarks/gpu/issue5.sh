#!/usr/bin/env bash
# GPU points of issue 5 (StreamingRetrievalMetric): the cuda tests, and the real 117,000 x 23,000 x 512 case on
# the GPU (time, peak allocated, ratio to the blocked matrix-product floor). Run from the repository root on a
# machine with one CUDA GPU; results go to benchmarks/results/gpu/retrieval_*. Every step runs; exit 1 if any failed.
set +e
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
out=benchmarks/results/gpu
mkdir -p "$out"
fail=0

echo "== retrieval cuda tests"
timeout 120 python3 -m pytest -q -m cuda -p no:cacheprovider tests/functional/test_retrieval.py \
  tests/metrics/test_streaming_retrieval.py 2>&1 | tee "$out/retrieval_cuda_tests.txt" | tail -3
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "FAILED: cuda tests"; fail=1; }

echo "== 117k x 23k x 512 on cuda (side by side with the floor, then each alone for peak allocated)"
timeout 150 python3 benchmarks/retrieval.py --device cuda --sizes 117k --repeats 3 --no-torchmetrics \
  --out "$out/retrieval_cuda_117k.json" 2>&1 | tee "$out/retrieval_cuda_117k.txt" | tail -12
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "FAILED: 117k benchmark"; fail=1; }

echo "== summary"
python3 - "$out/retrieval_cuda_117k.json" <<'PY' || fail=1
import json, sys
r = json.load(open(sys.argv[1]))
s = r["side_by_side"][0]
print(f"device {r['device']}: floor {s['median_seconds']['floor']:.3f} s, ours {s['median_seconds']['ours']:.3f} s,"
      f" ours/floor {s['ratios']['ours/floor']:.2f}x")
for p in r["own_process"]:
    if "peak_allocated_bytes" in p:
        print(f"  {p['config']:>6} alone: {p['seconds']:.3f} s, peak allocated {p['peak_allocated_bytes'] / 2**30:.2f} GiB,"
              f" peak RSS {p['peak_rss_bytes'] / 2**30:.2f} GiB")
    else:
        print(f"  {p['config']}: {p.get('error', 'no result')[-300:]}")
print("results:", {k: v for k, v in s["results"]["ours"].items()})
PY
[ "$fail" -eq 0 ] && echo "issue5 GPU points: all steps passed" || echo "issue5 GPU points: some step FAILED"
exit $fail
