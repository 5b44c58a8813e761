#!/usr/bin/env bash
# GPU points of issue 6 (MemoryAudit): the cuda-marked tests (a bf16 model on the GPU with a stray fp32 copy:
# the warning's byte figure against torch.cuda.memory_allocated) and the audit's cost on CUDA.
# Run from the repository root on a CUDA machine: bash benchmarks/gpu/issue6.sh
# Results go to benchmarks/results/gpu/ (memory_audit_*).
set +e
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=benchmarks/results/gpu
mkdir -p "$out"
fail=0
step() { echo "== $1: $2"; [ "$2" = ok ] || fail=1; }

timeout 180 python3 -m pytest -q -s -m cuda -p no:cacheprovider tests/callbacks/test_memory_audit.py \
  tests/functional/test_footprint.py tests/functional/test_conversion.py 2>&1 | tee "$out/memory_audit_cuda_tests.txt" | tail -5
[ "${PIPESTATUS[0]}" -eq 0 ] && step "cuda tests (duplicate copy vs allocator)" ok || step "cuda tests" FAILED

timeout 240 python3 benchmarks/memory_audit.py --device cuda --out "$out/memory_audit_cuda.json" 2>&1 | tail -8
[ "${PIPESTATUS[0]}" -eq 0 ] && step "audit cost on CUDA" ok || step "audit cost on CUDA" FAILED

echo "issue6.sh: $([ $fail -eq 0 ] && echo all steps passed || echo some steps FAILED)"
exit $fail
