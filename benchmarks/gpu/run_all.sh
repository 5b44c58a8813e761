#!/usr/bin/env bash
# Run the GPU scripts of the given issues (default: all) on a CUDA machine, each with a time limit,
# then pack benchmarks/results/gpu/ into $OUT/gpu_results.tgz when $OUT is set.
#
#   bash benchmarks/gpu/run_all.sh 2 3 5
set +e
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
limit=${GPU_SCRIPT_LIMIT_S:-300}
issues=("$@")
[ ${#issues[@]} -eq 0 ] && issues=(2 3 4 5 6 7)
mkdir -p benchmarks/results/gpu
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee benchmarks/results/gpu/device.txt
python3 -c "import torch, lightning, torchmetrics, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'lightning', lightning.__version__, 'torchmetrics', torchmetrics.__version__)" | tee -a benchmarks/results/gpu/device.txt
status=0
for n in "${issues[@]}"; do
  echo "=== issue $n ==="
  start=$(date +%s)
  timeout "$limit" bash "benchmarks/gpu/issue$n.sh" > "benchmarks/results/gpu/issue${n}_log.txt" 2>&1
  rc=$?
  tail -n 25 "benchmarks/results/gpu/issue${n}_log.txt"
  echo "=== issue $n: rc=$rc in $(( $(date +%s) - start )) s ==="
  [ $rc -eq 0 ] || status=1
done
if [ -n "${OUT:-}" ]; then
  tar czf "$OUT/gpu_results.tgz" benchmarks/results/gpu
fi
exit $status
