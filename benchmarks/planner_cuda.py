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
    python benchmarks/planner_cuda.py --recheck          # no GPU: this code's estimates vs the committed run

Needs a CUDA GPU (exits with a message and code 2 without one), except ``--recheck``: it estimates every case of a
GPU run's results again on this machine (``planner_cuda_recheck.json``), so a change to the CUDA model is judged
against measurements made on a real card. T5's attention bias is laid out as the run's transformers passed it
(permuted before 5.24; the results record the version).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_map

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _machine import machine_info  # noqa: E402  (benchmarks/_machine.py)
from planner import (  # noqa: E402
    PRECISIONS,
    _enable_checkpointing,
    checkpointing_kwargs,
    model_specs,
    plain_steps,
    spec_by_name,
    transformers_status,
)

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


def estimate_case(model: str, batch: int, precision: str, checkpointing: bool, gpu: tuple[int, int]) -> Any:
    """The CUDA estimate of one case: a ``benchmarks/planner.py`` model by name, or ``"zoo <entry>"``."""
    if model.startswith("zoo "):
        from tests.helpers.zoo import ZOO

        entry = ZOO[model[4:]]
        module, data = entry.build(batch_size=batch), entry.batch(batch)
        return estimate_memory(module, data, device="cuda", precision=precision, gpu=gpu)
    spec = spec_by_name(model, quick=False)
    return estimate_memory(
        spec.build(),
        spec.batch(batch),
        device="cuda",
        precision=precision,
        **checkpointing_kwargs(spec.checkpointing if checkpointing else None),
        gpu=gpu,
    )


def spec_rows(quick: bool, gpu: tuple[int, int]) -> list[dict]:
    rows: list[dict] = []
    for spec in model_specs(quick=False):
        for b in spec.batches[:1] if quick else spec.batches:
            for precision in PRECISIONS:
                for ckpt in (False,) if quick else (False, True):
                    label = {"model": spec.name, "batch": b, "precision": precision, "checkpointing": ckpt}

                    def work(spec=spec, b=b, precision=precision, ckpt=ckpt, label=label) -> dict:
                        est = estimate_case(spec.name, b, precision, ckpt, gpu)
                        measured = measured_plain(
                            spec.build, spec.batch(b), precision, spec.checkpointing if ckpt else None
                        )
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
                est = estimate_case(label["model"], batch_size, precision, False, gpu)
                measured = cuda_fit_peak(entry, precision, batch_size)
                return _row(label["model"], est, measured, **{k: v for k, v in label.items() if k != "model"})

            _safe(rows, label, work)
            print(_line(rows[-1]), flush=True)
    return rows


@contextlib.contextmanager
def _t5_bias_as_measured(measured_with: str | None) -> Iterator[None]:
    """Hugging Face T5's attention bias laid out as the transformers of the measured run passed it: before 5.24 it
    came permuted (last-dimension stride = the number of heads), which sends T5's self-attention to CUDA's math
    kernel; 5.24 made it contiguous. Without a recorded version, nothing changes."""
    try:
        import transformers.integrations.sdpa_attention as sdpa
    except ImportError:
        yield
        return
    original = getattr(sdpa, "create_position_bias_mask", None)
    old = measured_with is not None and tuple(int(x) for x in measured_with.split(".")[:2]) < (5, 24)
    if original is None or not old:
        yield
        return

    def permuted(position_bias: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        mask = original(position_bias, *args, **kwargs)
        heads_last = position_bias.dim() == mask.dim() == 4 and position_bias.stride(1) == 1 < position_bias.size(1)
        return mask.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2) if heads_last else mask

    sdpa.create_position_bias_mask = permuted
    try:
        yield
    finally:
        sdpa.create_position_bias_mask = original


def recheck(path: Path, out: Path | None) -> int:
    """Estimate again, on this CPU, every case of a GPU run's results and put it next to that run's measurement."""
    data = json.loads(path.read_text())
    gpu = tuple(data["machine"]["capability"])
    rows: list[dict] = []
    with _t5_bias_as_measured(data.get("transformers")):
        for r in (r for r in data["rows"] if "measured_bytes" in r):
            label = {k: r[k] for k in ("model", "batch", "precision") if k in r} | {
                "checkpointing": r.get("checkpointing")
            }

            def work(r: dict = r, label: dict = label) -> dict:
                est = estimate_case(r["model"], r["batch"], r["precision"], bool(r.get("checkpointing")), gpu)
                row = _row(r["model"], est, r["measured_bytes"], **{k: v for k, v in label.items() if k != "model"})
                return {**row, "ratio_in_the_run": r["ratio"]}

            _safe(rows, label, work)
            print(
                _line(rows[-1]) + (f" (in the run: {rows[-1]['ratio_in_the_run']:.4f})" if "ratio" in rows[-1] else "")
            )
    result = {
        "rechecked": str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path),
        "torch": torch.__version__,
    }
    result |= {"measured_on": data["machine"].get("gpu"), "verdict": verdict(rows), "rows": rows}
    print(json.dumps(result["verdict"], indent=2))
    text = json.dumps(result, indent=2) + "\n"
    (REPO / "benchmarks" / "results" / "planner_cuda_recheck.json").write_text(text)
    if out:
        out.write_text(text)
    return 0


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
    parser.add_argument(
        "--recheck",
        nargs="?",
        const=REPO / "benchmarks" / "results" / "planner_cuda.json",
        type=Path,
        help="no GPU: estimate a GPU run's cases again here and compare with its measurements",
    )
    args = parser.parse_args(argv)
    if args.recheck is not None:
        warnings.filterwarnings("ignore")
        return recheck(args.recheck, args.out)
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
        "transformers": transformers_status().get("version"),
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
