#!/usr/bin/env bash
# GPU points of issue 3 (OOMReporter): the cuda-marked tests (a real OOM + snapshot readable by
# torch.cuda._memory_viz) and one example report from a real CUDA OOM of a small transformer.
# Run from the repository root on a CUDA machine: bash benchmarks/gpu/issue3.sh
# Results go to benchmarks/results/gpu/ (oom_*).
set +e
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=benchmarks/results/gpu
mkdir -p "$out"
rm -f "$out"/oom_report_rank0*.json "$out"/oom_report_rank0*.md "$out"/oom_snapshot_rank0*.pickle  # one example only
fail=0
step() { echo "== $1: $2"; [ "$2" = ok ] || fail=1; }

timeout 120 python3 -m pytest -q -m cuda -p no:cacheprovider tests/callbacks/test_oom_reporter.py \
  tests/utilities/test_oom.py tests/functional/test_oom.py 2>&1 | tee "$out/oom_cuda_tests.txt" | tail -3
[ "${PIPESTATUS[0]}" -eq 0 ] && step "cuda tests" ok || step "cuda tests" FAILED

timeout 150 python3 benchmarks/oom_demo.py --out "$out" > "$out/oom_demo_stdout.txt" 2>&1
rc=$?
grep -v -E "^(GPU|TPU|LOCAL_RANK|HPU|💡)" "$out/oom_demo_stdout.txt" | tail -40
[ $rc -eq 0 ] && step "real OOM demo (report + snapshot)" ok || step "real OOM demo (rc=$rc)" FAILED

python3 -m lightning_memopt.cli report "$out/oom_report_rank0.json" > "$out/oom_report_cli.txt" 2>&1
[ $? -eq 0 ] && step "lightning-memopt report" ok || step "lightning-memopt report" FAILED

echo "== summary"
ls -l "$out"/oom_* 2>/dev/null
sed -n '/## Suggestions/,/^## Failing/p' "$out/oom_report_rank0.md" 2>/dev/null | head -12
echo "issue3.sh: $([ $fail -eq 0 ] && echo all steps passed || echo some steps FAILED)"
exit $fail
