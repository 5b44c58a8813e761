"""CUDA caching-allocator settings and the per-process memory fraction, applied at the right time.

Allocator settings (``PYTORCH_CUDA_ALLOC_CONF``, e.g. ``expandable_segments:True``) are read by torch when CUDA is
initialised. Before that they are applied through the environment variable; afterwards through torch's runtime
setter where this torch has one, otherwise a warning names the exact variable to export. Everything set here is
recorded and can be given back with :func:`restore_allocator_settings`. The callback that applies them for one run is
:class:`~lightning_memopt.callbacks.AllocatorSettings`, through :func:`borrow_allocator_conf` and
:func:`borrow_memory_fraction`: both settings belong to the process, so runs that overlap share them (the first in
applies, the last out gives back; see :mod:`~lightning_memopt.utilities.shared_state`).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lightning_memopt.utilities.checks import check_fraction
from lightning_memopt.utilities.shared_state import Lease, Restore, borrow
from lightning_memopt.utilities.warnings import WarnOnce

__all__ = [
    "ALLOC_CONF_ENV",
    "AllocatorState",
    "alloc_conf_env_name",
    "apply_allocator_conf",
    "apply_memory_fraction",
    "borrow_allocator_conf",
    "borrow_memory_fraction",
    "check_alloc_conf",
    "format_alloc_conf",
    "parse_alloc_conf",
    "restore_allocator_settings",
]

#: The variable every supported torch reads (torch >= 2.9 also reads ``PYTORCH_ALLOC_CONF`` first).
ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"
_NEW_ENV = "PYTORCH_ALLOC_CONF"
#: Values that undo a runtime change for keys whose torch default is known.
_RUNTIME_DEFAULTS = {
    "expandable_segments": "False",
    "release_lock_on_cudamalloc": "False",
    "pinned_use_cuda_host_register": "False",
}
#: What torch raises when a CUDA call cannot be made (``AssertionError`` on a torch built without CUDA).
_TORCH_ERRORS = (RuntimeError, AssertionError, ValueError, TypeError)


def parse_alloc_conf(conf: str | None) -> dict[str, str]:
    """``"a:1,b:2"`` -> ``{"a": "1", "b": "2"}``.

    Examples:
        >>> parse_alloc_conf("expandable_segments:True, max_split_size_mb:128")
        {'expandable_segments': 'True', 'max_split_size_mb': '128'}
    """
    out: dict[str, str] = {}
    for part in (conf or "").split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition(":")
        if not sep or not key.strip() or not value.strip():
            raise ValueError(
                f"`allocator_conf` entries must look like `key:value`, got {part!r} in {conf!r}."
                " Example: 'expandable_segments:True,max_split_size_mb:128'."
            )
        out[key.strip()] = value.strip()
    return out


def check_alloc_conf(conf: str | None) -> dict[str, str]:
    """Parse ``conf`` and refuse what cannot be applied from inside Python: a ``backend`` other than the one torch
    chose when it was imported (torch reads it at load time; a later change crashes CUDA's initialisation).

    Raises:
        ValueError: a malformed entry, or such a ``backend``, with the ``export`` line that sets it.

    Examples:
        >>> check_alloc_conf("expandable_segments:True")
        {'expandable_segments': 'True'}
    """
    wanted = parse_alloc_conf(conf)
    backend = wanted.get("backend")
    if backend is None:
        return wanted
    env_name = alloc_conf_env_name()
    try:
        loaded = parse_alloc_conf(os.environ.get(env_name)).get("backend", "native")
    except ValueError:  # the user's own malformed variable: torch reads it, not us
        loaded = "native"
    if backend != loaded:
        raise ValueError(
            f"`allocator_conf` sets backend:{backend}, but torch chose its allocator backend ({loaded!r}) when it"
            " was imported, before any callback or preset runs, and changing it later crashes CUDA's"
            f" initialisation. Drop `backend` from `allocator_conf` and export it before starting Python:"
            f" export {env_name}=backend:{backend}"
        )
    return wanted


def format_alloc_conf(settings: dict[str, str]) -> str:
    """Inverse of :func:`parse_alloc_conf`.

    Examples:
        >>> format_alloc_conf({"expandable_segments": "True"})
        'expandable_segments:True'
    """
    return ",".join(f"{k}:{v}" for k, v in settings.items())


def alloc_conf_env_name() -> str:
    """The variable to write: ``PYTORCH_ALLOC_CONF`` if the user already set it (it wins in new torch), else the
    CUDA one that every supported torch reads."""
    return _NEW_ENV if os.environ.get(_NEW_ENV) else ALLOC_CONF_ENV


def _runtime_setter() -> Callable[[str], None] | None:
    # The one private torch call of this module: torch has no public runtime setter for allocator settings. The
    # accelerator-wide one first: `torch.cuda.memory._set_allocator_settings` warns that it is deprecated (2.9+).
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    return setter if setter is not None else getattr(torch.cuda.memory, "_set_allocator_settings", None)


def _cuda_initialized() -> bool:
    try:
        return bool(torch.cuda.is_initialized())
    except _TORCH_ERRORS:
        return False


@dataclass
class AllocatorState:
    """What :func:`apply_allocator_conf` / :func:`apply_memory_fraction` changed, for restoring it."""

    how: str = "skipped"  #: "env", "runtime", "already", "warned" or "skipped"
    env_name: str | None = None
    previous_env: str | None = None
    runtime_keys: dict[str, str] = field(default_factory=dict)
    fraction_device: int | None = None
    previous_fraction: float | None = None


def apply_allocator_conf(conf: str | None, warn: WarnOnce | None = None) -> AllocatorState:
    """Apply allocator ``conf`` now: through the environment before CUDA is initialised, else at runtime.

    Keys the user already exported win over ``conf`` (an explicit environment beats a preset).

    Examples:
        >>> import os
        >>> old = os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        >>> state = apply_allocator_conf("expandable_segments:True")  # CUDA not initialised here
        >>> state.how, os.environ["PYTORCH_CUDA_ALLOC_CONF"]
        ('env', 'expandable_segments:True')
        >>> restore_allocator_settings(state); "PYTORCH_CUDA_ALLOC_CONF" in os.environ
        False
    """
    wanted = parse_alloc_conf(conf)
    state = AllocatorState()
    if not wanted:
        return state
    env_name = alloc_conf_env_name()
    existing_raw = os.environ.get(env_name)
    existing = parse_alloc_conf(existing_raw)
    merged = {**wanted, **existing}
    missing = {k: v for k, v in wanted.items() if existing.get(k) != v}
    if not _cuda_initialized():
        state.how, state.env_name, state.previous_env = "env", env_name, existing_raw
        os.environ[env_name] = format_alloc_conf(merged)
        return state
    if not missing:
        state.how = "already"
        return state
    setter = _runtime_setter()
    todo = {k: v for k, v in missing.items() if k not in existing}
    if setter is not None and todo:
        try:
            setter(format_alloc_conf(todo))
            state.how, state.runtime_keys = "runtime", todo
            return state
        except _TORCH_ERRORS as err:
            reason = f"torch's runtime setter refused it ({err})"
    else:
        reason = "this torch has no runtime setter for allocator settings"
    message = (
        f"CUDA was already initialised, so the allocator settings {format_alloc_conf(wanted)!r} could not be"
        f" applied ({reason}). Export them before starting Python: export {env_name}={format_alloc_conf(merged)}"
    )
    (warn or WarnOnce()).warn("alloc_conf", message)
    state.how = "warned"
    return state


def _cuda_index(device: torch.device) -> int:
    """The index of a CUDA device, the current one when ``device`` names none."""
    if device.index is not None:
        return device.index
    return torch.cuda.current_device()


def apply_memory_fraction(
    fraction: float | None, device: torch.device, state: AllocatorState | None = None, warn: WarnOnce | None = None
) -> AllocatorState:
    """``torch.cuda.set_per_process_memory_fraction(fraction, device)`` on CUDA devices; a warning elsewhere."""
    state = state or AllocatorState()
    if fraction is None:
        return state
    fraction = check_fraction("memory_fraction", fraction)  # a Python float, whatever real number came in
    device = torch.device(device)
    if device.type != "cuda":
        (warn or WarnOnce()).warn(
            "fraction", f"`memory_fraction`={fraction} limits CUDA memory only; ignored on device {device}."
        )
        return state
    index = _cuda_index(device)
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    previous = 1.0
    if getter is not None:
        try:
            previous = float(getter(index))
        except _TORCH_ERRORS:
            previous = 1.0
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    state.fraction_device, state.previous_fraction = index, previous
    return state


def restore_allocator_settings(state: AllocatorState) -> None:
    """Give back what ``state`` records: the environment variable, runtime keys with a known default, the fraction.

    A torch call that fails here is skipped, so that the rest is still given back (this runs at teardown, also while
    the user's exception unwinds).
    """
    if state.how == "env" and state.env_name is not None:
        if state.previous_env is None:
            os.environ.pop(state.env_name, None)
        else:
            os.environ[state.env_name] = state.previous_env
    elif state.how == "runtime":
        undo = {k: _RUNTIME_DEFAULTS[k] for k in state.runtime_keys if k in _RUNTIME_DEFAULTS}
        setter = _runtime_setter()
        if undo and setter is not None:
            with contextlib.suppress(*_TORCH_ERRORS):
                setter(format_alloc_conf(undo))
    if state.fraction_device is not None and state.previous_fraction is not None:
        with contextlib.suppress(*_TORCH_ERRORS):
            torch.cuda.set_per_process_memory_fraction(state.previous_fraction, state.fraction_device)
    state.how, state.fraction_device = "skipped", None


def _restorer(state: AllocatorState) -> Restore:
    return functools.partial(restore_allocator_settings, state)


def borrow_allocator_conf(conf: str, warn: WarnOnce | None = None) -> Lease | None:
    """:func:`apply_allocator_conf` for one run, shared by the runs of this process that overlap it.

    The first run in applies ``conf`` (the environment variable or, once CUDA is initialised, the runtime setter);
    a run that overlaps with a different ``conf`` runs with the first one's and is warned once; the last run out gives
    back what was there before the first (release the returned lease).

    Examples:
        >>> import os
        >>> old = os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        >>> first = borrow_allocator_conf("expandable_segments:True")  # CUDA not initialised here
        >>> second = borrow_allocator_conf("expandable_segments:True")
        >>> first.release(); os.environ["PYTORCH_CUDA_ALLOC_CONF"]
        'expandable_segments:True'
        >>> second.release(); "PYTORCH_CUDA_ALLOC_CONF" in os.environ
        False
    """
    wanted = format_alloc_conf(parse_alloc_conf(conf))
    if not wanted:
        return None
    return borrow(
        "cuda.allocator_settings", wanted, lambda v: _restorer(apply_allocator_conf(v, warn)), warn, "AllocatorSettings"
    )


def borrow_memory_fraction(fraction: float | None, device: torch.device, warn: WarnOnce | None = None) -> Lease | None:
    """:func:`apply_memory_fraction` for one run, shared per device by the runs of this process that overlap it.

    ``None`` (nothing held) when ``fraction`` is ``None`` or ``device`` is not a CUDA device (a warning then). The
    first run in on a device sets its fraction; an overlapping run with another fraction runs with the first one's
    and is warned once; the last run out gives back the fraction from before the first.
    """
    if fraction is None:
        return None
    check_fraction("memory_fraction", fraction)
    device = torch.device(device)
    if device.type != "cuda":
        apply_memory_fraction(fraction, device, warn=warn)  # warns that it is ignored here
        return None
    index = _cuda_index(device)

    def apply(value: float) -> Restore:
        return _restorer(apply_memory_fraction(value, torch.device("cuda", index), warn=warn))

    return borrow(f"cuda.memory_fraction:{index}", fraction, apply, warn, "AllocatorSettings")
