"""DreaMS as it is (``examples/dreams/as_is.py``): a ``pytorch_lightning`` FineTuningHead that keeps its backbone in
``save_hyperparameters``, ``DDPStrategy(find_unused_parameters=True)``, integer precision, ``trainer.validate``
before ``trainer.fit``, under 2 DDP processes on the CPU; the users' hand-written memory fixes next to the same
fixes with the package."""

from __future__ import annotations

import inspect
import json

import pytest

from tests.helpers.subprocess_run import SCRIPTS, run_file


def _code_lines(*objects) -> int:
    lines = [line.strip() for obj in objects for line in inspect.getsource(obj).splitlines()]
    return sum(1 for line in lines if line and not line.startswith(("#", '"""')))


def test_the_package_says_the_fixes_in_fewer_lines():
    from examples.dreams import as_is

    hand = _code_lines(as_is.EmptyCacheEveryBatch, as_is.CollectGarbage, as_is.hand_written_trainer)
    package = _code_lines(as_is.package_trainer)
    assert package < hand, (package, hand)


@pytest.mark.slow
def test_dreams_as_it_is_under_two_ddp_processes(tmp_path):
    from examples.dreams.data import generate_spectra_h5

    generate_spectra_h5(tmp_path / "spectra.hdf5", num_spectra=200, seed=0)
    # one 2-process run fits both, the package's way first: what it restores at teardown must not reach the other
    proc = run_file(SCRIPTS / "dreams_as_is_ddp.py", tmp_path, timeout=300, args=("package", "hand"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {
        variant: [json.loads((tmp_path / f"{variant}_rank{r}.json").read_text()) for r in (0, 1)]
        for variant in ("package", "hand")
    }
    for variant, ranks in results.items():
        for r in ranks:  # the same effective batch either way: 1 sample x 2 devices x 2 accumulated
            assert (r["global_step"], r["accumulate_grad_batches"], r["batch_size"]) == (4, 2, 1), variant
        assert ranks[0]["weights"] == ranks[1]["weights"], variant  # DDP kept the ranks equal
    package, hand = results["package"], results["hand"]
    # Lightning swaps precision=16 for bf16 on a CPU; MemoryPrecision runs the fp16 asked for (same on a GPU)
    assert package[0]["precision"] == "16-mixed" and hand[0]["precision"] == "bf16-mixed"
    assert {"MemoryAudit", "GarbageCollector", "CacheCleaner", "GradientCheckpointing"} <= set(package[0]["callbacks"])
    for rank in (0, 1):  # each process holds its own stray copy, and each says so
        found = [w for w in package[rank]["warnings"] if "are not owned by the model" in w]
        assert len(found) == 1, package[rank]["warnings"]
        assert f"[rank {rank}]" in found[0] and "Held at self._hparams_initial['backbone']" in found[0]
        assert 'self.save_hyperparameters(ignore=["backbone"])' in found[0]
    assert not [w for w in hand[0]["warnings"] if "are not owned" in w]  # nobody looked for it by hand
