"""Accuracy of ``estimate_memory(..., device="cuda")`` against a real GPU: the allocator's own peak.

For every case of ``benchmarks/planner.py`` (the DreaMS-style and CLIP-style examples, a plain
``nn.TransformerEncoder`` language model, a tiny Hugging Face T5 if ``transformers`` is installed; each batch size,
fp32 and bf16-mixed, checkpointing off and on) the CUDA estimate (fake tensors on the CPU, ``gpu=`` the card's
compute capability) is put next to ``torch.cuda.max_memory_allocated()`` over the same two training steps run for
real on the GPU: a plain loop in Lightning's order (training step under CUDA autocast for bf16-mixed, ``zero_grad``,
backward, optimizer step), from an empty allocator (cached blocks and cuBLAS workspaces released, peak reset) with
the model and the batch moved to the GPU inside the measured span.

Then every entry of the test suite's zoo (``tests/helpers/zoo.py``) is trained by a real ``Trainer.fit`` on the GPU
(two optimizer steps, fp32 and bf16-mixed) and its allocator peak is put next to the estimate of its batch.

The allocator counts what the estimate leaves out on purpose (``docs/estimate.md``, "What is modelled for CUDA"):
cuDNN workspaces (convolutions, RNNs), kernels' own scratch, and for ``Trainer.fit`` Lightning's few tensors. Each
row says estimated / measured; the verdict is the worst ratio and how many cases fall within 5 % and 10 %.

    python benchmarks/planner_cuda.py                    # every case: about a minute on an H100
    python benchmarks/planner_cuda.py --quick            # one batch size per model, no checkpointing
    python benchmarks/planner_cuda.py --out /tmp/x.json  # also writes benchmarks/results/planner_cuda.json

Needs a CUDA GPU (exits with a message and code 2 without one).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_map

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _machine import machine_info  # noqa: E402  (benchmarks/_machine.py)
from planner import PRECISIONS, _enable_checkpointing, model_specs, plain_steps  # noqa: E402

from lightning_memopt.planner import estimate_memory  # noqa: E402
from tests.helpers.measured_step import cuda_fit_peak, empty_cuda_allocator  # noqa: E402

#: The ratios counted in the verdict.
BANDS = (0.05, 0.10)


def _to_cuda(batch: Any) -> Any:
    return tree_map(lambda t: t.cuda() if isinstance(t, torch.Tensor) else t, batch)


def measured_plain(build: Any, batch: Any, precision: str, checkpointing: Any) -> int:
    """The allocator's peak of two real steps in Lightning's order, the model and batch moved to the GPU inside."""
    module = build()
    if checkpointing:
        _enable_checkpointing(module, checkpointing)
    base = empty_cuda_allocator()
    module = module.cuda()
    batch = _to_cuda(batch)
    plain_steps(module, batch, precision, device_type="cuda")
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del module, batch
    return peak


def _row(model: str, estimate: Any, measured: int, **fields: Any) -> dict[str, Any]:
    attention = next((a for a in estimate.assumptions if a.startswith("attention")), None)
    return {
        "model": model,
        **fields,
        "estimated_bytes": estimate.peak_bytes,
        "workspace_bytes": estimate.at_peak.get("workspace", 0),
        "measured_bytes": measured,
        "ratio": estimate.peak_bytes / measured,
        "attention": attention,
    }


def _safe(rows: list[dict], label: dict[str, Any], work: Any) -> None:
    try:
        rows.append(work())
    except Exception as err:  # a benchmark row, not a crash: the error is the result
        rows.append({**label, "error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"})


def spec_rows(quick: bool, gpu: tuple[int, int]) -> list[dict]:
    rows: list[dict] = []
    for spec in model_specs(quick=False):
        for b in spec.batches[:1] if quick else spec.batches:
            for precision in PRECISIONS:
                for ckpt in (False,) if quick else (False, True):
                    label = {"model": spec.name, "batch": b, "precision": precision, "checkpointing": ckpt}
                    checkpointing = spec.checkpointing if ckpt else None

                    def work(spec=spec, b=b, precision=precision, checkpointing=checkpointing, label=label) -> dict:
                        est = estimate_memory(
                            spec.build(),
                            spec.batch(b),
                            device="cuda",
                            precision=precision,
                            checkpointing=checkpointing,
                            gpu=gpu,
                        )
                        measured = measured_plain(spec.build, spec.batch(b), precision, checkpointing)
                        return _row(spec.name, est, measured, **{k: v for k, v in label.items() if k != "model"})

                    _safe(rows, label, work)
                    print(_line(rows[-1]), flush=True)
    return rows


def zoo_rows(gpu: tuple[int, int], batch_size: int = 8) -> list[dict]:
    from tests.helpers.zoo import ZOO

    rows: list[dict] = []
    for entry in ZOO.values():
        for precision in PRECISIONS:
            label = {"model": f"zoo {entry.name}", "batch": batch_size, "precision": precision, "by": "Trainer.fit"}

            def work(entry=entry, precision=precision, label=label) -> dict:
                est = estimate_memory(
                    entry.build(batch_size=batch_size),
                    entry.batch(batch_size),
                    device="cuda",
                    precision=precision,
                    gpu=gpu,
                )
                measured = cuda_fit_peak(entry, precision, batch_size)
                return _row(label["model"], est, measured, **{k: v for k, v in label.items() if k != "model"})

            _safe(rows, label, work)
            print(_line(rows[-1]), flush=True)
    return rows


def _line(r: dict) -> str:
    ckpt = r.get("checkpointing", "-")
    head = f"  {r['model']:<11} b={r.get('batch', ''):<5} {r.get('precision', ''):<10} ckpt={ckpt!s:<5}"
    if "error" in r:
        return f"{head} FAILED: {r['error']}"
    kernel = (r["attention"] or "").partition(": ")[2][:40]
    return (
        f"{head} est {r['estimated_bytes']:>14,} measured {r['measured_bytes']:>14,}"
        f" ratio {r['ratio']:.4f} (workspace {r['workspace_bytes']:,}) {kernel}"
    )


def verdict(rows: list[dict]) -> dict[str, Any]:
    judged = [r for r in rows if "ratio" in r]
    worst = max(judged, key=lambda r: abs(r["ratio"] - 1), default=None)
    return {
        "cases": len(judged),
        "failed": [f"{r['model']} {r.get('precision')}" for r in rows if "error" in r],
        "worst_ratio": worst["ratio"] if worst else None,
        "worst_case": _line(worst).strip() if worst else None,
        **{f"within_{band:.0%}": sum(abs(r["ratio"] - 1) <= band for r in judged) for band in BANDS},
        "under_estimates": sum(r["ratio"] < 1 for r in judged),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one batch size per model, no checkpointing")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("planner_cuda.py needs a CUDA GPU; none is available.", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore")
    gpu = torch.cuda.get_device_capability()
    t0 = time.perf_counter()
    print(f"{torch.cuda.get_device_name()} (sm{gpu[0]}{gpu[1]}), torch {torch.__version__}", flush=True)
    rows = spec_rows(args.quick, gpu) + zoo_rows(gpu)
    result = {
        "machine": {**machine_info(), "gpu": torch.cuda.get_device_name(), "capability": list(gpu)},
        "torch": torch.__version__,
        "seconds": round(time.perf_counter() - t0, 1),
        "verdict": verdict(rows),
        "rows": rows,
    }
    print(json.dumps(result["verdict"], indent=2))
    text = json.dumps(result, indent=2) + "\n"
    (REPO / "benchmarks" / "results" / "planner_cuda.json").write_text(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
