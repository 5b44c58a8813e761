"""The precision decision: Lightning's precision names, what a device computes natively, and the precision chosen.

Nothing here touches a device or a Trainer: every decision takes plain values (device type, compute capability,
device name, the Trainer's ``strategy=``) so that it can be tested on a machine without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

from lightning_memopt.utilities.checks import check_choice
from lightning_memopt.utilities.state import StateField, as_float, as_int, load_state

__all__ = [
    "PRECISION_ALIASES",
    "PRECISION_MODES",
    "UNSUPPORTED_STRATEGIES",
    "PrecisionChoice",
    "PrecisionInput",
    "PrecisionMode",
    "choose_precision",
    "double_cast",
    "fsdp2_policy",
    "has_native_bf16",
    "checked_scaler_state",
    "has_own_precision",
    "normalize_precision",
    "own_precision_strategy",
]

#: Modes of ``MemoryPrecision`` and ``MemoryPreset(precision=...)``: Lightning's precision strings plus ``"auto"``.
PrecisionMode = Literal[
    "auto",
    "32-true",
    "16-mixed",
    "bf16-mixed",
    "16-true",
    "bf16-true",
    "64-true",
    "transformer-engine",
    "transformer-engine-float16",
]
PRECISION_MODES: tuple[str, ...] = get_args(PrecisionMode)

#: The short names Lightning's Trainer also accepts (as str or int), mapped as Lightning maps them.
PRECISION_ALIASES = {"16": "16-mixed", "bf16": "bf16-mixed", "32": "32-true", "64": "64-true"}

#: Every precision value Lightning's Trainer accepts, and ``"auto"``.
PrecisionInput = Literal[PrecisionMode, "16", "bf16", "32", "64", 16, 32, 64]


def normalize_precision(value: Any, name: str = "precision") -> str:
    """Lightning's precision ``value`` (``16``, ``"16"``, ``"bf16"``, ``"16-mixed"``, ...) as its full name.

    The short names map as Lightning's Trainer maps them: ``16`` / ``"16"`` to ``"16-mixed"``, ``"bf16"`` to
    ``"bf16-mixed"``, ``32`` to ``"32-true"``, ``64`` to ``"64-true"``. Anything else gets an error naming ``name``.

    Examples:
        >>> [normalize_precision(v) for v in (16, "16", "bf16", 32, "64", "bf16-true", "auto")]
        ['16-mixed', '16-mixed', 'bf16-mixed', '32-true', '64-true', 'bf16-true', 'auto']
    """
    check_choice(
        name,
        value,
        (*PRECISION_MODES, *PRECISION_ALIASES, 16, 32, 64),
        hint="These are the values `Trainer(precision=...)` accepts, and 'auto'.",
    )
    key = str(value)
    return PRECISION_ALIASES.get(key, key)


def has_native_bf16(device_type: str, capability: tuple[int, int] | None) -> bool:
    """Whether ``device_type`` with compute ``capability`` computes bf16 in hardware.

    ``torch.cuda.is_bf16_supported()`` also counts emulation (True on a V100); native bf16 on CUDA needs compute
    capability >= 8.0 (Ampere). CPUs run bf16 autocast everywhere torch supports it.

    Examples:
        >>> has_native_bf16("cuda", (7, 0)), has_native_bf16("cuda", (8, 0)), has_native_bf16("cpu", None)
        (False, True, True)
    """
    if device_type == "cuda":
        return capability is not None and tuple(capability) >= (8, 0)
    return device_type in ("cpu", "xpu")


@dataclass(frozen=True)
class PrecisionChoice:
    """The Lightning precision string chosen, the reason in words, and a summary short enough for one line."""

    precision: str
    reason: str
    summary: str = ""


def _describe_device(device_type: str, capability: tuple[int, int] | None, device_name: str | None) -> str:
    name = device_name or device_type
    if capability is not None:
        return f"{name} (compute capability {capability[0]}.{capability[1]})"
    return name


def choose_precision(
    precision: str,
    device_type: str,
    capability: tuple[int, int] | None = None,
    device_name: str | None = None,
    allow_emulated_bf16: bool = False,
    setting: str = "precision={!r}",
) -> PrecisionChoice:
    """Resolve a ``MemoryPrecision`` ``precision`` to a Lightning precision string for one device.

    ``"auto"`` picks ``bf16-mixed`` on a GPU with native bf16, ``16-mixed`` (with a GradScaler) on older GPUs and
    ``32-true`` on CPU and other devices. Asking for bf16 on a CUDA GPU without native bf16 raises (suggesting fp16)
    unless ``allow_emulated_bf16`` is set. Lightning's short names (``16``, ``"bf16"``, ...) are accepted
    (:func:`normalize_precision`). ``setting`` is where the user sets the precision, as a template for the messages
    (``"MemoryPrecision(precision={!r})"``).

    Examples:
        >>> choose_precision("auto", "cuda", (8, 0), "NVIDIA A100").precision
        'bf16-mixed'
        >>> choose_precision("auto", "cuda", (7, 0), "Tesla V100").summary
        "'16-mixed' on Tesla V100 (no native bf16: fp16 with a GradScaler)"
        >>> choose_precision("auto", "cpu").precision
        '32-true'
        >>> choose_precision("bf16-mixed", "cuda", (7, 5), "Tesla T4")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: `precision='bf16-mixed'` needs native bf16, but Tesla T4 (compute capability 7.5) ...
    """
    precision = normalize_precision(precision)
    where = _describe_device(device_type, capability, device_name)
    name = device_name or device_type
    native = has_native_bf16(device_type, capability)
    if precision == "auto":
        if device_type == "cuda" and native:
            reason = f"{where} has native bf16: bf16 autocast, no loss scaling needed."
            return PrecisionChoice("bf16-mixed", reason, f"'bf16-mixed' on {name} (native bf16)")
        if device_type == "cuda":
            reason = (
                f"{where} has no native bf16 (needs compute capability >= 8.0; torch would emulate it slowly):"
                " fp16 autocast with a GradScaler."
            )
            return PrecisionChoice("16-mixed", reason, f"'16-mixed' on {name} (no native bf16: fp16 with a GradScaler)")
        reason = (
            f"mixed precision is chosen automatically only on CUDA GPUs; {where} trains in fp32. Set"
            f" `{setting.format('bf16-mixed')}` to use bf16 autocast anyway (there, not `Trainer(precision=...)`,"
            " which Lightning refuses beside this package's precision plugin)."
        )
        return PrecisionChoice("32-true", reason, f"'32-true' on {name} (autocast is chosen on CUDA GPUs only)")
    if precision.startswith("bf16") and device_type == "cuda" and not native:
        if allow_emulated_bf16:
            reason = f"{where} emulates bf16 (slow); used because `allow_emulated_bf16=True`."
            return PrecisionChoice(precision, reason, f"{precision!r} on {name} (emulated bf16)")
        fp16 = precision.replace("bf16", "16")
        raise ValueError(
            f"`{setting.format(precision)}` needs native bf16, but {where} has none (compute capability >= 8.0 is"
            f" needed; `torch.cuda.is_bf16_supported()` also counts slow emulation). Use `{setting.format(fp16)}`"
            " (fp16 with loss scaling) or pass `allow_emulated_bf16=True`."
        )
    reason = f"`{setting.format(precision)}` was asked for explicitly on {where}."
    return PrecisionChoice(precision, reason, f"{precision!r} on {name} (asked for)")


#: Strategies that bring their own precision classes; ``MemoryPrecision`` refuses them instead of misbehaving, and
#: ``MemoryPreset.trainer_kwargs`` gives them a precision string instead of the plugin.
UNSUPPORTED_STRATEGIES = ("FSDPStrategy", "DeepSpeedStrategy", "ModelParallelStrategy", "XLAFSDPStrategy")


def own_precision_strategy(strategy: Any) -> str | None:
    """The entry of :data:`UNSUPPORTED_STRATEGIES` that ``strategy`` (a Trainer's ``strategy=``: a name such as
    ``"deepspeed_stage_2"``, or an object) is; ``None`` when it is none of them.

    Examples:
        >>> own_precision_strategy("deepspeed_stage_2"), own_precision_strategy("ddp")
        ('DeepSpeedStrategy', None)
    """
    if strategy is None:
        return None
    if isinstance(strategy, str):
        key = strategy.lower().replace("_", "")
        return next((n for n in UNSUPPORTED_STRATEGIES if n.lower().removesuffix("strategy") in key), None)
    found = {cls.__name__ for cls in type(strategy).__mro__}.intersection(UNSUPPORTED_STRATEGIES)
    return sorted(found)[0] if found else None


def has_own_precision(strategy: Any) -> bool:
    """Whether ``strategy`` (a Trainer's ``strategy=``: a name such as ``"deepspeed_stage_2"``, or an object) is
    one of :data:`UNSUPPORTED_STRATEGIES`, which bring their own precision classes.

    Examples:
        >>> [has_own_precision(s) for s in ("fsdp", "deepspeed_stage_3", "xla_fsdp", "ddp", "auto", None)]
        [True, True, True, False, False, False]
    """
    return own_precision_strategy(strategy) is not None


#: FSDP2's own mixed precision for a Lightning precision string: ``MixedPrecisionPolicy`` keyword arguments, as dtype
#: names (``torch.<name>``). Parameters are cast once per unit and gradients reduced in float32.
_FSDP2_POLICIES = {
    "bf16-mixed": {"param_dtype": "bfloat16", "reduce_dtype": "float32"},
    "16-mixed": {"param_dtype": "float16", "reduce_dtype": "float32"},
}


def fsdp2_policy(precision: Any) -> str | None:
    """The ``MixedPrecisionPolicy`` that gives ``fully_shard`` the mixed precision ``precision`` names, as code, for a
    ``configure_model`` that lets FSDP own precision while the Trainer keeps ``precision="32-true"``; ``None`` for a
    precision that is not mixed.

    Examples:
        >>> fsdp2_policy("bf16-mixed"), fsdp2_policy("32")
        ('MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)', None)
    """
    policy = _FSDP2_POLICIES.get(normalize_precision(precision))
    if policy is None:
        return None
    return "MixedPrecisionPolicy(" + ", ".join(f"{name}=torch.{dtype}" for name, dtype in policy.items()) + ")"


def double_cast(precision: Any, param_dtype: str | None) -> bool:
    """Whether the Trainer's ``precision`` (autocast: ``*-mixed``) and FSDP2's ``MixedPrecisionPolicy.param_dtype``
    (``Sharding.param_dtype``, e.g. ``"torch.bfloat16"``) both lower the compute precision: the model is then cast
    twice (FSDP casts the parameters per unit, autocast each operation again). Keep one of the two.

    Examples:
        >>> double_cast("bf16-mixed", "torch.bfloat16"), double_cast("32-true", "torch.bfloat16")
        (True, False)
        >>> double_cast("bf16-mixed", None), double_cast("bf16-mixed", "torch.float32")
        (False, False)
    """
    mixed = normalize_precision(precision) in _FSDP2_POLICIES
    return mixed and param_dtype is not None and param_dtype.removeprefix("torch.") in ("bfloat16", "float16")


def _scale(value: Any) -> float:
    number = as_float(0.0)(value)
    if number <= 0:
        raise ValueError("not positive")
    return number


#: A ``torch.amp.GradScaler``'s state. Harmless to lose: a fresh scaler finds its scale again within a few steps
#: (each overflow skips one step), so a bad or missing key warns and the whole scaler starts fresh.
_SCALER_STATE = {
    "scale": StateField(_scale, "a finite, positive number"),
    "growth_factor": StateField(_scale, "a finite, positive number"),
    "backoff_factor": StateField(_scale, "a finite, positive number"),
    "growth_interval": StateField(as_int(1), "a positive int"),
    "_growth_tracker": StateField(as_int(0), "a non-negative int"),
}


def checked_scaler_state(state: Any, has_scaler: bool, owner: str = "MemoryPrecision") -> dict[str, Any] | None:
    """A checkpoint's precision ``state``, checked, ready for a precision plugin's ``load_state_dict``; or ``None``.

    A plugin with a gradient scaler (``has_scaler``) gets the scaler's five keys, each checked; one that is missing or
    bad warns (naming ``owner`` and the key; the warning points at the caller) and gives ``None``: the scaler stays
    fresh. An empty state (a run without a scaler) gives ``None`` silently. A plugin without a scaler keeps no state:
    a non-empty one warns and gives ``None``.

    Examples:
        >>> checked_scaler_state({}, has_scaler=True) is None
        True
        >>> good = {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 7}
        >>> checked_scaler_state({**good, "_growth_tracker": 3}, has_scaler=True)["growth_interval"]
        7
    """
    if isinstance(state, dict) and not state:
        return None
    if not has_scaler:
        load_state(owner, state, {})  # warns about what it ignores
        return None
    checked = load_state(owner, state, _SCALER_STATE)
    return checked if all(value is not None for value in checked.values()) else None
