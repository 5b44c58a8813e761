"""Peak memory of ``lightning-memopt analyze`` on a large log pair, as a ratio to the logs' size.

Writes two ``memory_rank{r}.jsonl`` files in the shape MemoryMonitor writes (train steps, a validation
phase every 1000 steps, every memory field filled in) into a temporary directory, then runs the analysis in a
fresh interpreter and reads that interpreter's peak resident set size (``ru_maxrss``) twice: after importing
the command line (the baseline) and after the analysis.

    python benchmarks/analyze_memory.py                   # 600000 lines in all, about 250 MiB
    python benchmarks/analyze_memory.py --lines 60000 --plot
    python benchmarks/analyze_memory.py --out benchmarks/results/analyze_memory_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MiB = 1024**2

#: Runs in the child: baseline after the imports, peak after the analysis, both from ru_maxrss.
CHILD = r"""
import json, resource, sys, time
from lightning_memopt.cli import main
import lightning_memopt.analysis.memory_log  # noqa: F401  (part of the baseline)
scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
start = time.perf_counter()
code = main(sys.argv[1:])
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
print("RESULT " + json.dumps({"exit_code": code, "baseline_rss_bytes": base, "peak_rss_bytes": peak,
                              "seconds": seconds}), file=sys.stderr)
"""


def _events(per_rank: int):
    """(phase, event, step advances) in the order MemoryMonitor writes them: validation every 1000 steps."""
    yield "train", "phase_start", False
    written, step = 1, 0
    while written < per_rank - 1:
        if step and step % 1000 == 0:
            yield from [
                ("validate", "phase_start", False),
                *[("validate", "step", False)] * 5,
                ("validate", "phase_end", False),
            ]
            written += 7
        yield "train", "step", True
        step += 1
        written += 1
    yield "train", "phase_end", False


def write_log_pair(directory: Path, lines: int, seed: int = 0) -> list[Path]:
    """Write about ``lines`` records in all, split over ranks 0 and 1; returns the two paths."""
    rng = random.Random(seed)
    paths = []
    for rank in (0, 1):
        path = directory / f"memory_rank{rank}.jsonl"
        paths.append(path)
        t, step = 1_700_000_000.0, 0
        with open(path, "w", encoding="utf-8") as f:
            for phase, event, advances in _events(lines // 2):
                step += advances
                alloc = 6 * 1024**3 + 4 * step + rng.randrange(64 * MiB)
                record = {
                    "time": round(t, 6),
                    "rank": rank,
                    "phase": phase,
                    "event": event,
                    "epoch": step // 5000,
                    "global_step": step,
                    "batch_idx": None if event != "step" else step % 5000,
                    "device": f"cuda:{rank}",
                    "allocated_bytes": alloc,
                    "reserved_bytes": alloc + 2 * 1024**3,
                    "active_bytes": alloc,
                    "peak_allocated_bytes": alloc + 512 * MiB,
                    "peak_reserved_bytes": alloc + 3 * 1024**3,
                    "device_total_bytes": 85_029_158_912,
                    "device_free_bytes": 70_000_000_000 - alloc,
                    "host_rss_bytes": 4 * 1024**3 + rng.randrange(MiB),
                    "num_alloc_retries": 0,
                    "num_ooms": 0,
                }
                f.write(json.dumps(record) + "\n")
                t += 0.05
    return paths


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=600_000, help="records in the two logs together")
    parser.add_argument("--plot", action="store_true", help="also write the timeline plot")
    parser.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)
    if args.lines < 2:
        parser.error(f"`--lines` must be at least 2, got {args.lines}")

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        start = time.perf_counter()
        paths = write_log_pair(tmp_path, args.lines)
        size = sum(p.stat().st_size for p in paths)
        print(f"wrote {args.lines} lines, {size / MiB:.1f} MiB in {time.perf_counter() - start:.1f} s")
        command = [sys.executable, "-c", CHILD, "analyze", *map(str, paths)]
        if args.plot:
            command += ["--plot", str(tmp_path / "timeline.png")]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        proc = subprocess.run(command, capture_output=True, text=True, env=env)
        result_line = next((line for line in proc.stderr.splitlines() if line.startswith("RESULT ")), None)
        if result_line is None:
            sys.exit(f"the analysis did not report its memory (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        child = json.loads(result_line[len("RESULT ") :])

    growth = child["peak_rss_bytes"] - child["baseline_rss_bytes"]
    result = {
        "benchmark": "analyze_memory",
        "lines": args.lines,
        "plot": args.plot,
        "log_bytes": size,
        **child,
        "growth_rss_bytes": growth,
        "peak_rss_over_log_size": round(child["peak_rss_bytes"] / size, 3),
        "growth_rss_over_log_size": round(growth / size, 3),
    }
    print(f"logs:          {size / MiB:8.1f} MiB ({args.lines} lines)")
    print(f"baseline RSS:  {child['baseline_rss_bytes'] / MiB:8.1f} MiB (interpreter with the CLI imported)")
    print(f"peak RSS:      {child['peak_rss_bytes'] / MiB:8.1f} MiB = {result['peak_rss_over_log_size']:.2f}x the logs")
    print(f"RSS growth:    {growth / MiB:8.1f} MiB = {result['growth_rss_over_log_size']:.2f}x the logs")
    print(f"analysis took: {child['seconds']:8.1f} s (exit code {child['exit_code']})")
    if args.out is not None:
        from _machine import machine_info  # benchmarks/_machine.py

        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**result, "machine": machine_info()}, indent=2) + "\n")
        print(f"result: {args.out}")
    return result


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
