"""A simulated 2-node x 2-process DDP job (gloo, CPU) on one machine (``tests/analysis/test_two_nodes.py``).

``python two_nodes.py`` (in an empty directory) starts four ranks of this file by hand, each with the environment a
cluster launcher gives (``NODE_RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), which
Lightning's ``LightningEnvironment`` takes: ranks 0-1 are node 0, ranks 2-3 node 1, in
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
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

NUM_NODES = 2
DEVICES = 2
#: The rank that runs out of memory in ``validate``: node 1's second process.
FAILING_RANK = 3
#: Seconds the launcher waits for the ranks before ending them.
LIMIT = 120


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


def launch() -> int:
    """Start the four ranks with a launcher's environment; wait for them (ending them all after ``LIMIT`` s)."""
    port = str(_free_port())
    procs = []
    for rank in range(NUM_NODES * DEVICES):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=str(NUM_NODES * DEVICES))
        env.update(NODE_RANK=str(rank // DEVICES), LOCAL_RANK=str(rank % DEVICES), OMP_NUM_THREADS="1")
        log = open(f"rank{rank}.log", "w")  # noqa: SIM115 - kept open for the child's lifetime, closed below
        procs.append((subprocess.Popen([sys.executable, __file__, "worker"], env=env, stdout=log, stderr=log), log))
    deadline = time.monotonic() + LIMIT
    codes = []
    for proc, log in procs:
        try:
            codes.append(proc.wait(timeout=max(deadline - time.monotonic(), 0.1)))
        except subprocess.TimeoutExpired:
            for other, _ in procs:
                other.kill()
            codes.append(proc.wait())
        log.close()
    tails = [Path(f"rank{r}.log").read_text()[-3000:] for r in range(len(procs))]
    with open("ranks.json", "w") as f:
        json.dump({"codes": codes, "tails": tails}, f)
    return 0


def worker() -> None:
    """One rank: fit, then validate where ``FAILING_RANK`` runs out of memory."""
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
        strategy=DDPStrategy(timeout=timedelta(seconds=60)),
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
        print(
            f"validate ran out of memory on rank {trainer.global_rank} ({time.monotonic() - start:.1f} s)", flush=True
        )
        os._exit(3)  # at once: the other ranks see a peer gone, never a hang
    print(f"validate done ({time.monotonic() - start:.1f} s)", flush=True)


if __name__ == "__main__":
    worker() if sys.argv[1:] == ["worker"] else sys.exit(launch())
