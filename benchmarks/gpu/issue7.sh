#!/usr/bin/env bash
# GPU points of issue 7 (examples): the DreaMS-style script with the dreams-base model (~95M parameters) on the
# GPU, once with `--preset max-savings` and once in fp32 (`--preset none --train_precision 32`), at the same
# effective batch; both memory logs, their analyze plots and the peak figures go to benchmarks/results/gpu/.
# Also the CLIP-style retrieval example at full size (117,120 clips, 23,592 captions) on the GPU.
# Run from the repository root on a CUDA machine: bash benchmarks/gpu/issue7.sh
set +e
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=benchmarks/results/gpu
mkdir -p "$out"
fail=0
step() { echo "== $1: $2"; [ "$2" = ok ] || fail=1; }
common=(--model_preset dreams-base --accelerator gpu --effective_batch_size 256 --max_steps 40 --max_epochs 1
        --limit_val_batches 4 --num_spectra 20000 --data_path outputs/gpu/dreams.hdf5 --no-progress_bar)

for cfg in max-savings fp32; do
  if [ "$cfg" = fp32 ]; then flags=(--preset none --train_precision 32 --batch_size 64); else flags=(--preset max-savings --batch_size 32); fi
  timeout 240 python3 examples/dreams/train.py "${common[@]}" "${flags[@]}" --output_dir "outputs/gpu/dreams_$cfg" \
    > "$out/dreams_${cfg}_stdout.txt" 2>&1
  rc=$?
  log=$(ls -t outputs/gpu/dreams_"$cfg"/version_*/memory/memory_rank0.jsonl 2>/dev/null | head -1)
  if [ $rc -eq 0 ] && [ -n "$log" ]; then
    cp "$log" "$out/dreams_${cfg}_memory_rank0.jsonl"
    python3 -m lightning_memopt.cli analyze "$log" --plot "$out/dreams_${cfg}_memory.png" | tee "$out/dreams_${cfg}_summary.txt"
    step "dreams-base $cfg" ok
  else
    tail -20 "$out/dreams_${cfg}_stdout.txt"; step "dreams-base $cfg (rc=$rc)" FAILED
  fi
done
python3 - "$out" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
peaks = {}
for cfg in ("max-savings", "fp32"):
    path = out / f"dreams_{cfg}_memory_rank0.jsonl"
    if path.exists():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        peaks[cfg] = max((r.get("peak_allocated_bytes") or 0) for r in rows)
for cfg, b in peaks.items():
    print(f"{cfg}: peak allocated {b / 2**30:.2f} GiB")
if len(peaks) == 2 and peaks["fp32"]:
    print(f"max-savings / fp32 peak: {peaks['max-savings'] / peaks['fp32']:.2f}")
(out / "dreams_peaks.json").write_text(json.dumps(peaks, indent=2) + "\n")
PY

timeout 240 python3 examples/clip_retrieval/train.py --accelerator gpu --num_samples 117120 --num_unique_texts 23592 \
  --max_epochs 1 --max_steps 200 --limit_train_batches 200 --no-progress_bar --root outputs/gpu/clip \
  > "$out/clip_full_stdout.txt" 2>&1
[ $? -eq 0 ] && step "CLIP-style full size" ok || step "CLIP-style full size" FAILED
tail -25 "$out/clip_full_stdout.txt"
echo "issue7.sh: $([ $fail -eq 0 ] && echo all steps passed || echo some steps FAILED)"
exit $fail
