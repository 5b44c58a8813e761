import gc
import os

import pytest
import torch

os.environ.setdefault("PL_DISABLE_FORK", "1")


def pytest_configure(config):
    """One share of the cores per xdist worker, for its own threads and for every process it starts.

    Two workers of two torch threads each on two cores run the suite 1.6 times slower (measured on the zoo, the
    examples and the DDP failure runs: 94 s against 56 s). A thread count set by the caller is kept.
    """
    if not hasattr(config, "workerinput"):  # not an xdist worker (the controller's env reaches the workers)
        return
    workers = config.workerinput["workercount"]
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_finish(session):
    """Freeze what the imports and the collection made: about a million objects in a worker (torch, Lightning,
    transformers, the test items), which MemoryAudit's scan of ``gc.get_objects()`` and every full collection during a
    test's fit would otherwise walk again (the full suite: 412 s of CPU time without, 333 s with). What a test makes
    is not frozen. Tests of the package's own freeze run in an unfrozen process: the ``unfrozen_gc`` fixture (the
    autouse fixture below does not check the freeze: ``gc.get_freeze_count()`` walks every frozen object).
    """
    gc.collect()
    gc.freeze()


@pytest.fixture
def unfrozen_gc():
    """The process as it is without the suite's freeze (``gc.get_freeze_count() == 0``); the freeze is put back
    after the test."""
    gc.unfreeze()
    yield
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    for item in items:  # the zoo runs in the full suite (`pytest -m zoo` alone), not in the quick `-m "not slow"` loop
        if "zoo" in item.keywords and "slow" not in item.keywords:
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _restore_global_state():
    """Fail loudly if a test leaves process-wide state changed."""
    gc_enabled = gc.isenabled()
    thresholds = gc.get_threshold()
    matmul = torch.get_float32_matmul_precision()
    yield
    if gc.isenabled() != gc_enabled:
        gc.enable() if gc_enabled else gc.disable()
        pytest.fail("test left automatic garbage collection changed")
    if gc.get_threshold() != thresholds:
        gc.set_threshold(*thresholds)
        pytest.fail("test left gc thresholds changed")
    if torch.get_float32_matmul_precision() != matmul:
        torch.set_float32_matmul_precision(matmul)
        pytest.fail("test left float32 matmul precision changed")


@pytest.fixture
def one_process_group(tmp_path):
    """A gloo process group of one process, destroyed afterwards (skipped where one is already initialized)."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
