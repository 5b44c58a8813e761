"""The sharded cases of ``benchmarks/planner.py``: the per-rank peak of an FSDP2 step, predicted and measured.

The models: the residual MLP of ``tests/scripts/fsdp2_peak.py`` (4 blocks of width 128, a head, batch 16) and the
test suite's zoo T5 (``benchmarks/_fsdp2_zoo.py``: its 2+2 blocks, batch 8, padded sources); plain AdamW,
``fully_shard`` per block and at the root. The truth is measured by the test suite's script, run unchanged with N
gloo processes (forked; for T5 through ``_fsdp2_zoo.py``, which puts the T5 in place of the MLP): each rank's peak
over two steps in Lightning's order for ``reshard_after_forward`` True and False and for AdamW's ``foreach`` step.
Beside it, in a fresh process per world size: ``estimate_memory(..., device="cpu", world_size=N)`` (its seconds and
its RSS growth) and torch's ``FSDPMemTracker`` over the same steps on fake tensors in a fake process group (its
prediction, seconds and RSS growth). On the CPU all three must agree to the byte.

Measured (``planner_sharded_cpu.json``): the planner equals every rank's peak to the byte, AdamW's ``foreach`` step
included (the fake tensors DTensor makes to learn an operator's output shape are memory to neither counter); torch's
tracker does too, and it cannot run the zoo T5 (a data-dependent ``.item()`` under its fake mode:
``DataDependentOutputException``), which the planner estimates.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import _fsdp2_zoo  # noqa: E402  (benchmarks/_fsdp2_zoo.py)

from tests.scripts import fsdp2_peak  # noqa: E402  (the model and the gloo worker of the test suite)

__all__ = [
    "MODELS",
    "OPTIONS",
    "ShardedModel",
    "cases",
    "measured_peaks",
    "print_sharded",
    "print_sharded_check",
    "sharded_case_rows",
    "sharded_check",
    "sharded_worker",
]

#: The options fsdp2_peak.py measures, by its JSON key: (reshard_after_forward, AdamW foreach).
OPTIONS: dict[str, tuple[bool, bool]] = {"true": (True, False), "false": (False, False), "foreach": (True, True)}
WORLD_SIZES = (2, 4)


@dataclass(frozen=True)
class ShardedModel:
    """A model of the sharded cases: its description, how to build it and its batch, the gloo script measuring it."""

    description: str
    build: Callable[[], nn.Module]
    batch: Callable[[], torch.Tensor]
    script: Path


MODELS = {
    "mlp": ShardedModel(
        f"ResidualMLP(width {fsdp2_peak.WIDTH}, {fsdp2_peak.BLOCKS} blocks), batch {fsdp2_peak.BATCH}",
        fsdp2_peak.ResidualMLP,
        fsdp2_peak.make_batch,
        REPO / "tests" / "scripts" / "fsdp2_peak.py",
    ),
    "t5": ShardedModel(
        f"zoo T5 (transformers, 2+2 blocks, d_model 32), batch {_fsdp2_zoo.BATCH}",
        _fsdp2_zoo.ZooT5,
        _fsdp2_zoo.make_batch,
        REPO / "benchmarks" / "_fsdp2_zoo.py",
    ),
}


def cases(quick: bool) -> list[tuple[str, int]]:
    """(model, world size) run: ``--quick`` one 2-process MLP case (seconds); the full run both models on 2 and 4
    (T5 only where transformers is installed)."""
    if quick:
        return [("mlp", 2)]
    names = ["mlp", *(["t5"] if find_spec("transformers") is not None else [])]
    return [(name, world_size) for name in names for world_size in WORLD_SIZES]


def _optimizer(foreach: bool) -> Callable[[Any], torch.optim.Optimizer]:
    return functools.partial(torch.optim.AdamW, lr=1e-3, foreach=foreach)  # as fsdp2_peak.py builds it


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


# ----------------------------------------------------------------------------------------------- the truth: gloo
def measured_peaks(model: str, world_size: int, timeout: float = 300) -> dict:
    """Run the model's gloo script with ``world_size`` processes: each option's peak on every rank."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, str(MODELS[model].script), _free_port(), str(world_size)],
            cwd=tmp,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        seconds = time.perf_counter() - started
        if proc.returncode != 0:
            return {"error": proc.stderr[-3000:]}
        ranks = [json.loads((Path(tmp) / f"peak_{rank}.json").read_text()) for rank in range(world_size)]
    return {"per_rank": {key: [r[key] for r in ranks] for key in OPTIONS}, "seconds": seconds}


# ----------------------------------------------------------------------------------------------- the predictions
def _planner(model: ShardedModel, world_size: int, reshard: bool, foreach: bool) -> int:
    from lightning_memopt.planner import estimate_memory

    est = estimate_memory(
        model.build(),
        (model.batch(),),  # one positional argument, as the gloo script calls the model
        device="cpu",
        world_size=world_size,
        reshard_after_forward=reshard,
        optimizer=_optimizer(foreach),
    )
    return est.peak_bytes


def _tracker(spec: ShardedModel, world_size: int, reshard: bool, foreach: bool) -> int:
    """torch's ``FSDPMemTracker``: the caller sets up fake mode and a fake process group, shards and steps."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.fsdp import fully_shard

    from lightning_memopt.functional.planning.sharding import fake_process_group
    from tests.scripts import fsdp2_peak

    with fake_process_group(world_size) as mesh, FakeTensorMode():
        torch.manual_seed(0)
        model = spec.build()
        for unit in [*model.blocks, model]:
            fully_shard(unit, mesh=mesh["data_parallel"], reshard_after_forward=reshard)
        optimizer = _optimizer(foreach)(model.parameters())
        return fsdp2_peak.tracker_peak(model, optimizer, spec.batch())["Total"]


def _timed(fn: Callable[[], int], rss: dict[str, Callable[[], Any]]) -> dict:
    """``fn()``'s bytes, its seconds and the growth of the process's peak RSS over it."""
    rss["trim"]()
    before = rss["now"]()
    reset = rss["reset_peak"]()
    started = time.perf_counter()
    try:
        nbytes = fn()
    except Exception as err:  # a benchmark row, not a crash: torch's tracker may not run where ours does
        return {"error": f"{type(err).__name__}: {err}"}
    seconds = time.perf_counter() - started
    return {"bytes": nbytes, "seconds": seconds, "rss_growth": rss["peak"]() - before, "peak_reset": reset}


def sharded_worker(name: str, world_size: int, rss: dict[str, Callable[[], Any]]) -> dict:
    """In a fresh process: each option predicted by the planner and by ``FSDPMemTracker``, timed, with RSS growth.

    The first call of each (the ``"true"`` case) is timed apart too: it imports FSDP2 and fills caches."""
    torch.set_num_threads(1)
    model = MODELS[name]
    first = {
        "planner": _timed(functools.partial(_planner, model, world_size, True, False), rss),
        "tracker": _timed(functools.partial(_tracker, model, world_size, True, False), rss),
    }
    options = {}
    for key, (reshard, foreach) in OPTIONS.items():
        options[key] = {
            "planner": _timed(functools.partial(_planner, model, world_size, reshard, foreach), rss),
            "tracker": _timed(functools.partial(_tracker, model, world_size, reshard, foreach), rss),
        }
    return {"first_call": first, "options": options, "process_peak_rss": rss["peak"]()}


# ----------------------------------------------------------------------------------------------- rows, table, check
def _ratio(a: int | None, b: int | None) -> float | None:
    return a / b if a is not None and b else None


def sharded_case_rows(name: str, world_size: int, measured: dict, predicted: dict) -> list[dict]:
    """One row per option: predicted (planner, tracker), measured per rank, ratios, seconds and RSS growth."""
    rows = []
    for key, (reshard, foreach) in OPTIONS.items():
        row: dict[str, Any] = {
            "model": name,
            "description": MODELS[name].description,
            "world_size": world_size,
            "reshard_after_forward": reshard,
            "foreach": foreach,
        }
        if "error" in measured or "error" in predicted:
            row["error"] = measured.get("error") or predicted.get("error")
            rows.append(row)
            continue
        per_rank = measured["per_rank"][key]
        planner, tracker = predicted["options"][key]["planner"], predicted["options"][key]["tracker"]
        row.update(
            measured_per_rank=per_rank,
            measured_bytes=min(per_rank),
            measured_run_seconds=measured["seconds"],
            predicted_bytes=planner.get("bytes"),
            ratio=_ratio(planner.get("bytes"), min(per_rank)),
            estimate_seconds=planner.get("seconds"),
            estimate_rss_growth=planner.get("rss_growth"),
            tracker_bytes=tracker.get("bytes"),
            tracker_ratio=_ratio(tracker.get("bytes"), min(per_rank)),
            tracker_seconds=tracker.get("seconds"),
            tracker_rss_growth=tracker.get("rss_growth"),
        )
        for field, part in (("estimate_error", planner), ("tracker_error", tracker)):
            if "error" in part:
                row[field] = part["error"]
        rows.append(row)
    return rows


def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e6:.2f} MB"


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def print_sharded(rows: list[dict]) -> None:
    print(
        "\nSharded (FSDP2, fully_shard per block and at the root, AdamW, 2 steps, device='cpu'): predicted per rank"
        " vs the real per-rank peak of N gloo processes (tests/scripts/fsdp2_peak.py), and torch's FSDPMemTracker"
    )
    print(
        f"  {'model':<5} {'ranks':>5} {'reshard':<7} {'foreach':<7} {'measured (per rank)':<24} {'planner':>10}"
        f" {'ratio':>7} {'est s':>6} {'est RSS':>9}   {'tracker':>10} {'ratio':>7} {'trk s':>6} {'trk RSS':>9}"
    )
    for r in rows:
        head = f"  {r['model']:<5} {r['world_size']:>5} {r['reshard_after_forward']!s:<7} {r['foreach']!s:<7}"
        if "error" in r:
            print(f"{head} FAILED: {r['error'].strip().splitlines()[-1] if r['error'].strip() else '?'}")
            continue
        ranks = sorted(set(r["measured_per_rank"]))
        measured = _mb(ranks[0]) + ("" if len(ranks) == 1 else f" (+{(ranks[-1] - ranks[0]):,} B on a rank)")
        print(
            f"{head} {measured:<24} {_mb(r['predicted_bytes']):>10} {_num(r['ratio'], '.4f'):>7}"
            f" {_num(r['estimate_seconds'], '.2f'):>6} {_mb(r['estimate_rss_growth']):>9}"
            + (
                f"   tracker failed: {r['tracker_error'].split(':')[0]}"
                if "tracker_error" in r
                else f"   {_mb(r['tracker_bytes']):>10} {_num(r['tracker_ratio'], '.4f'):>7}"
                f" {_num(r['tracker_seconds'], '.2f'):>6} {_mb(r['tracker_rss_growth']):>9}"
            )
        )
    print(
        "  (seconds and RSS growth of one call in a fresh process per world size, after a first call that imports"
        " FSDP2; every rank measures the same shapes: FSDP2 pads the shards)"
    )


def sharded_check(rows: list[dict]) -> dict:
    """PASS: on every case the planner's bytes equal the lowest rank's measured peak, and every rank's is within one
    unit's parameters of it (gloo's worker thread may hold a finished collective's buffer a moment longer; the test
    suite allows the same). How many cases are exact on every rank, and where torch's tracker agrees, is recorded."""
    ok = [r for r in rows if "error" not in r and r.get("predicted_bytes") is not None]
    exact = [r for r in ok if r["predicted_bytes"] == r["measured_bytes"]]
    within = [r for r in exact if max(r["measured_per_rank"]) - r["predicted_bytes"] <= _unit_bytes(r["model"])]
    return {
        "target": "planner == measured peak per rank, to the byte",
        "cases": len(rows),
        "exact_lowest_rank": len(exact),
        "exact_every_rank": sum(set(r["measured_per_rank"]) == {r["predicted_bytes"]} for r in ok),
        "tracker_equal": sum(r.get("tracker_bytes") == r["predicted_bytes"] for r in ok),
        "tracker_ran": sum(r.get("tracker_bytes") is not None for r in ok),
        "pass": bool(rows) and len(within) == len(rows),
    }


def _unit_bytes(name: str) -> int:
    """The most bytes of one block's parameters, unsharded (float32)."""
    return max(4 * sum(p.numel() for p in block.parameters()) for block in MODELS[name].build().blocks)


def print_sharded_check(c: dict) -> None:
    print(
        f"{'PASS' if c['pass'] else 'FAIL'}  sharded: planner == measured per-rank peak on {c['exact_lowest_rank']}"
        f" of {c['cases']} cases ({c['exact_every_rank']} equal on every rank); torch's FSDPMemTracker equal on"
        f" {c['tracker_equal']} of {c['tracker_ran']} it ran"
    )
