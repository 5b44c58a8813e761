#!/usr/bin/env bash
# GPU points of the foundation: cuda tests, callback overhead on the GPU, one real CUDA memory log + plot.
# Run from the repository root on a CUDA machine; results go to benchmarks/results/gpu/.
set +e
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=benchmarks/results/gpu
mkdir -p "$out"
fail=0
python3 -m pytest -q -m cuda -p no:cacheprovider tests/functional/test_memory.py tests/callbacks/test_memory_monitor.py \
  tests/callbacks/test_cache_cleaner.py 2>&1 | tee "$out/foundation_cuda_tests.txt" | tail -3
[ "${PIPESTATUS[0]}" -eq 0 ] || fail=1
python3 benchmarks/callback_overhead.py --accelerator gpu --rounds 4 --steps 300 \
  --out "$out/callback_overhead.json" 2>&1 | grep -v -E "^(GPU|TPU|LOCAL_RANK|HPU|💡)" | tail -9 || fail=1
rm -rf /tmp/qs
python3 examples/quickstart.py --accelerator gpu --max_steps 400 --width 4096 --batch_size 256 --root /tmp/qs \
  > "$out/quickstart_stdout.txt" 2>&1 || fail=1
log=$(ls /tmp/qs/lightning_logs/version_0/memory/memory_rank0.jsonl)
cp "$log" "$out/quickstart_memory_rank0.jsonl"
python3 -m lightning_memopt.cli analyze "$out/quickstart_memory_rank0.jsonl" --plot "$out/quickstart_memory.png" \
  | tee "$out/quickstart_analyze.txt" || fail=1
exit $fail
