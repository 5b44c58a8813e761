"""The quarantine for private Lightning APIs: every private Lightning name the package touches is reached here.

``AutoMicroBatch`` replaces Lightning's automatic-optimization loop object and runs the steps of a batch itself, which
needs a few private names of the Trainer's namespace (``lightning.pytorch`` or ``pytorch_lightning``).
:func:`check_private_api` looks every one of them up once, in ``setup``: a Lightning release that moved one gives a
clear error naming the release, the names and the supported range before anything runs, never an ``AttributeError``
at the first batch. ``tests/test_namespaces.py`` runs the check and the callback on the oldest release served.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from types import ModuleType
from typing import TYPE_CHECKING, Any

from lightning_memopt.utilities.namespaces import MIN_VERSION, namespace_of

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "PRIVATE_NAMES",
    "TESTED_UP_TO",
    "automatic_optimization",
    "call_strategy_hook",
    "check_private_api",
    "current_fx_name",
    "logged_results",
    "point_results",
    "results_batch",
    "set_current_fx_name",
    "should_accumulate",
]

#: The newest Lightning minor release the package is tested on (``pyproject.toml`` allows up to the next one).
TESTED_UP_TO = (2, 6)

#: Each private name, as ``module: attribute.attribute`` under the Trainer's namespace.
PRIVATE_NAMES = (
    "loops.optimization.automatic:_AutomaticOptimization._make_closure",
    "loops.optimization.automatic:_AutomaticOptimization._make_zero_grad_fn",
    "loops.optimization.automatic:_AutomaticOptimization._make_backward_fn",
    "loops.optimization.automatic:Closure",
    "loops.optimization.automatic:ClosureResult.from_training_step_output",
    "loops.fit_loop:_FitLoop._should_accumulate",
    "trainer.call:_call_strategy_hook",
    "trainer.trainer:Trainer._results",
    "trainer.connectors.logger_connector.result:_ResultCollection._extract_batch_size",
)


def _find(namespace: str, name: str) -> Any:
    module_name, attributes = name.split(":")
    found: Any = importlib.import_module(f"{namespace}.{module_name}")
    for attribute in attributes.split("."):
        found = getattr(found, attribute)
    return found


def _release(namespace: str) -> str:
    distribution = "lightning" if namespace == "lightning.pytorch" else "pytorch-lightning"
    try:
        return f"{distribution} {importlib.metadata.version(distribution)}"
    except importlib.metadata.PackageNotFoundError:
        return distribution


@functools.cache
def check_private_api(namespace: str) -> None:
    """Look up every name of :data:`PRIVATE_NAMES` in ``namespace`` (once per process and namespace).

    Raises:
        RuntimeError: naming the release, the names it lacks and the supported range.

    Examples:
        >>> check_private_api("lightning.pytorch")
    """
    missing = []
    for name in PRIVATE_NAMES:
        try:
            _find(namespace, name)
        except (ImportError, AttributeError):
            missing.append(f"{namespace}.{name}")
    if missing:
        low, high = ".".join(map(str, MIN_VERSION)), ".".join(map(str, TESTED_UP_TO))
        raise RuntimeError(
            f"AutoMicroBatch needs private parts of Lightning that {_release(namespace)} does not have: {missing}."
            f" It supports Lightning {low} to {high}: install a release in that range, or remove AutoMicroBatch."
        )


def automatic_optimization(namespace: str) -> ModuleType:
    """``<namespace>.loops.optimization.automatic`` (``_AutomaticOptimization``, ``Closure``, ``ClosureResult``)."""
    return importlib.import_module(f"{namespace}.loops.optimization.automatic")


def call_strategy_hook(trainer: pl.Trainer, hook: str, *args: Any) -> Any:
    """Run the strategy's ``hook`` as Lightning's loops do (profiled, ``_current_fx_name`` set)."""
    return _call_module(namespace_of(trainer).__name__)._call_strategy_hook(trainer, hook, *args)


@functools.cache
def _call_module(namespace: str) -> ModuleType:
    return importlib.import_module(f"{namespace}.trainer.call")


def should_accumulate(trainer: pl.Trainer) -> bool:
    """Whether the running training batch accumulates (no optimizer step after it)."""
    return bool(trainer.fit_loop._should_accumulate())


def current_fx_name(pl_module: pl.LightningModule) -> str | None:
    """The hook ``self.log`` logs under."""
    return pl_module._current_fx_name


def set_current_fx_name(pl_module: pl.LightningModule, name: str | None) -> None:
    pl_module._current_fx_name = name


def logged_results(trainer: pl.Trainer) -> Any:
    """The running loop's ``self.log`` results (``None`` in predict)."""
    return trainer._results


def results_batch(results: Any) -> tuple[Any, int | None]:
    """The batch the results weight ``self.log`` values by, and its cached size (``(None, None)`` without results)."""
    if results is None:
        return None, None
    return results.batch, results.batch_size


def point_results(results: Any, batch: Any, size: int | None) -> None:
    """Weight the next ``self.log`` values by ``batch`` of ``size`` samples (``None``: inferred from ``batch``), as
    Lightning does at each loader batch."""
    if results is not None:
        results.batch, results.batch_size = batch, size
