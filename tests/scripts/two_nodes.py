"""A simulated 2-node x 2-process DDP job (gloo, CPU) on one machine (``tests/analysis/test_two_nodes.py``).

``python two_nodes.py`` (in an empty directory; Linux: the ranks are forked) starts four ranks by hand, each with
the environment a cluster launcher gives (``NODE_RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``), which Lightning's ``LightningEnvironment`` takes: ranks 0-1 are node 0, ranks 2-3 node 1, in
``Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy="ddp")``. Each node has a host name of its own
(``sim-node-{n}``: ``socket.gethostname`` is replaced in the worker) and a log directory of its own
(``node{n}/memopt``), as two machines would. The fit (``MemoryMonitor`` and ``OOMReporter``, 3 steps) ends
normally on every rank; then ``trainer.validate`` runs and rank 3 (node 1, local rank 1) raises
``torch.OutOfMemoryError`` at its first batch, so node 1 also holds an out-of-memory report. The launcher writes
``ranks.json``: each rank's exit code and what it printed last.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

NUM_NODES = 2
DEVICES = 2
#: The rank that runs out of memory in ``validate``: node 1's second process.
FAILING_RANK = 3
#: Seconds the launcher waits for the ranks before ending them.
LIMIT = 300


def fake_host(node_rank: int) -> str:
    """The host name node ``node_rank`` reports.

    Example:
        >>> fake_host(1)
        'sim-node-1'
    """
    return f"sim-node-{node_rank}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_rank(rank: int, port: str) -> int:
    """Fork one rank with the environment a launcher gives it, its output to ``rank{rank}.log``; its pid.

    Forked after the imports (torch, Lightning, the package): each rank does not pay for them again, which keeps the
    four ranks' start to about one interpreter's on a 2-core machine. No torch thread exists yet to be lost.
    """
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        log = os.open(f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=str(NUM_NODES * DEVICES))
        os.environ.update(NODE_RANK=str(rank // DEVICES), LOCAL_RANK=str(rank % DEVICES), OMP_NUM_THREADS="1")
        code = worker()
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return 0  # not reached


def _wait(pids: list[int]) -> list[int]:
    """The exit codes of ``pids``, every rank ended after ``LIMIT`` seconds (``-9`` then)."""
    deadline = time.monotonic() + LIMIT
    codes: dict[int, int] = {}
    while len(codes) < len(pids):
        for pid in pids:
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            for pid in set(pids) - set(codes):
                os.kill(pid, signal.SIGKILL)
                codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        time.sleep(0.05)
    return [codes[pid] for pid in pids]


def launch() -> int:
    """Start the four ranks; wait for them; write ``ranks.json``."""
    import lightning.pytorch  # noqa: F401 - imported once, before the ranks are forked

    import lightning_memopt  # noqa: F401
    import tests.helpers.trainer  # noqa: F401

    port = str(_free_port())
    pids = [_start_rank(rank, port) for rank in range(NUM_NODES * DEVICES)]
    codes = _wait(pids)
    tails = [Path(f"rank{r}.log").read_text()[-3000:] for r in range(len(pids))]
    with open("ranks.json", "w") as f:
        json.dump({"codes": codes, "tails": tails}, f)
    return 0


def worker() -> int:
    """One rank: fit, then validate where ``FAILING_RANK`` runs out of memory; the rank's exit code."""
    start = time.monotonic()
    node_rank = int(os.environ["NODE_RANK"])
    socket.gethostname = lambda: fake_host(node_rank)  # this process plays a machine of its own
    import torch
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_memopt import MemoryMonitor, OOMReporter
    from tests.helpers.models import TinyModel
    from tests.helpers.trainer import make_trainer

    torch.set_num_threads(1)

    class FailsOnOneRank(TinyModel):
        def validation_step(self, batch, batch_idx):
            if self.global_rank == FAILING_RANK and self.trainer.state.fn == "validate":
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (rank 3, node 1)")
            return super().validation_step(batch, batch_idx)

    directory = f"node{node_rank}/memopt"
    trainer = make_trainer(
        ".",
        devices=DEVICES,
        num_nodes=NUM_NODES,
        strategy=DDPStrategy(timeout=timedelta(seconds=300)),
        max_steps=3,
        limit_train_batches=3,
        limit_val_batches=1,
        callbacks=[MemoryMonitor(dirpath=directory), OOMReporter(dirpath=directory, max_listed=0)],
    )
    model = FailsOnOneRank()
    trainer.fit(model)
    print(f"fit done: rank {trainer.global_rank}, node {trainer.node_rank}, local rank {trainer.local_rank}", end="")
    print(f" ({time.monotonic() - start:.1f} s)", flush=True)
    try:
        trainer.validate(model, verbose=False)
    except torch.OutOfMemoryError:
        print(f"out of memory on rank {trainer.global_rank} ({time.monotonic() - start:.1f} s)", flush=True)
        return 3  # at once: the other ranks see a peer gone, never a hang
    print(f"validate done ({time.monotonic() - start:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(launch())
