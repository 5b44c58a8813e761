#!/usr/bin/env bash
# GPU points of issue 4 (MemoryPreset, MemoryPrecision, GradientCheckpointing, allocator settings): the cuda tests
# (bf16 detection on the real card, the fp16 GradScaler path, checkpointing's peak allocated, the memory fraction)
# and the presets benchmark (fp32 baseline vs each preset at the same effective batch, peak allocated + samples/s).
# Run from the repository root on a machine with one CUDA GPU: bash benchmarks/gpu/issue4.sh
# Results go to benchmarks/results/gpu/presets_*. Every step runs; exit 1 if any failed.
set +e
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
out=benchmarks/results/gpu
mkdir -p "$out"
fail=0
step() { echo "== $1: $2"; [ "$2" = ok ] || fail=1; }

timeout 150 python3 -m pytest -q -s -m cuda -p no:cacheprovider tests/plugins/test_precision.py \
  tests/plugins/test_presets.py tests/plugins/test_accumulation.py tests/callbacks/test_gradient_checkpointing.py \
  tests/utilities/test_allocator.py 2>&1 | grep -v -E "^(GPU|TPU|LOCAL_RANK|HPU|💡)" | tee "$out/presets_cuda_tests.txt" | tail -12
[ "${PIPESTATUS[0]}" -eq 0 ] && step "cuda tests" ok || step "cuda tests" FAILED

timeout 240 python3 benchmarks/presets.py --device cuda --repeats 2 --out "$out/presets_cuda.json" 2>&1 \
  | tee "$out/presets_cuda.txt" | tail -10
[ "${PIPESTATUS[0]}" -eq 0 ] && step "presets benchmark" ok || step "presets benchmark" FAILED

python3 - "$out/presets_cuda.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
met = r.get("max_savings_target_met")
print(f"max-savings target (>= 60 % lower peak allocated, <= 30 % lower samples/s) on {r['machine'].get('gpu')}:"
      f" {'met' if met else 'NOT met'}")
sys.exit(0 if met else 1)
PY
[ $? -eq 0 ] && step "max-savings target" ok || step "max-savings target" FAILED

echo "issue4 GPU points: $([ $fail -eq 0 ] && echo all steps passed || echo some step FAILED)"
exit $fail
