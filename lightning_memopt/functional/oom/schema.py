"""The out-of-memory report's format: every key of ``oom_report_rank{r}.json``, defined once, as TypedDicts.

:class:`OOMReport` is the whole report; each section has a TypedDict of its own. Keys marked ``Required`` are
always there; the others are missing when the part that fills them failed (the failure is then listed in
``report_errors``) or, for ``top_tensors``, when ``OOMReporter(max_listed=0)``. ``docs/oom-report.md``
describes every key.
"""

from typing import Any

from typing_extensions import Required, TypedDict

__all__ = [
    "REPORT_FORMAT",
    "BatchLengths",
    "BatchSection",
    "DataLengths",
    "BatchTensor",
    "ChainedError",
    "CheckpointingState",
    "ConfigSection",
    "ErrorSection",
    "FootprintRowDict",
    "HoldersSection",
    "LiveTensorDict",
    "MemorySection",
    "OOMReport",
    "ShardingSection",
    "SnapshotSection",
    "Suggestion",
    "WhenSection",
]

#: Identifies the JSON report and its schema version (the ``format`` key).
REPORT_FORMAT = "lightning-memopt/oom-report/1"


class WhenSection(TypedDict, total=False):
    """``when``: the moment and place of the failure. Only the first four keys if the trainer could not be read."""

    time: Required[float]  # Unix time of the report
    rank: Required[int]  # global rank
    world_size: Required[int]
    run_id: Required[str | None]  # the run id shared by all ranks (see `lightning_memopt.utilities.run_id`)
    local_rank: int
    node_rank: int
    host: str  # the machine's name (socket.gethostname()), to tell the nodes of a job apart
    fn: str | None  # trainer function: "fit", "validate", "test", "predict"
    stage: str | None  # "train", "validate", "test", "predict", "sanity_check"
    epoch: int
    global_step: int
    batch_idx: int | None  # the local `batch_idx` of the innermost traceback frame that has one
    device: str


class ChainedError(TypedDict):
    """One entry of ``error.chain``: an exception the one before it (the reported one, for the first entry) was
    raised from or while handling."""

    relation: str  # "cause" (`raise ... from it`) or "context" (raised while it was being handled)
    type: str  # qualified class name
    message: str
    location: str | None  # "function (file:line)" of its innermost traceback frame


class ErrorSection(TypedDict, total=False):
    """``error``: the exception; ``chain`` only when it was raised from, or while handling, other exceptions
    (reports written before 0.2 have no ``chain``)."""

    type: Required[str]  # qualified class name, e.g. "torch.OutOfMemoryError"
    message: Required[str]
    location: Required[str | None]  # "function (file:line)" of the innermost traceback frame
    chain: list[ChainedError]  # the exceptions behind it, nearest first (at most 8)


class BatchTensor(TypedDict):
    """One tensor of the failing batch."""

    path: str  # where in the batch, e.g. "batch['x']"
    shape: list[int]
    dtype: str
    device: str
    bytes: int


class BatchLengths(TypedDict):
    """One entry of ``batch.lengths``: the per-sample lengths a padding mask (or labels padded with -100) gives."""

    path: str  # the tensor they were read from
    samples: int
    padded_to: int  # the tensor's second dimension
    longest: int
    shortest: int
    median: int
    padding_share: float  # padded positions / all positions
    lengths: list[int]  # per sample, the first 64


class DataLengths(TypedDict):
    """``batch.data_lengths``: the samples' lengths of the first training batches, as ``OOMReporter`` sampled them."""

    batches: int  # batches sampled
    samples: int  # their samples
    p99: int  # the length 99 % of them fit in
    longest: int


class BatchSection(TypedDict, total=False):
    """``batch``: the failing batch. Empty if it could not be described; without a local ``batch``, only
    ``found_in`` (``None``), ``tensors`` (empty), ``num_tensors`` (0) and ``micro_batch_size`` (``None``)."""

    type: str  # the batch's class name
    tensors: list[BatchTensor]  # the first 32 tensors
    num_tensors: int  # all tensors, also those past the first 32
    truncated: bool
    bytes: int  # bytes of the listed tensors
    micro_batch_size: int | None  # first dimension of the first tensor that has one
    lengths: list[BatchLengths]  # only where the batch has padding masks (or labels padded with -100)
    data_lengths: DataLengths  # only where OOMReporter sampled the first training batches' lengths
    found_in: str | None  # "function (file:line)" of the frame whose local `batch` was read


class MemorySection(TypedDict, total=False):
    """``memory``: the reading at the failure (:class:`~lightning_memopt.functional.readings.memory.MemoryReading`,
    taken
    before anything else), the allocator summary and the numbers in the error message (``message_*``)."""

    time: float
    device: str
    allocated_bytes: int | None
    reserved_bytes: int | None
    active_bytes: int | None
    peak_allocated_bytes: int | None
    peak_reserved_bytes: int | None
    device_total_bytes: int | None
    device_free_bytes: int | None
    host_rss_bytes: int | None
    num_alloc_retries: int | None
    num_ooms: int | None
    summary: str | None  # `torch.<device>.memory_summary(abbreviated=True)`, None where the backend has none
    message_requested_bytes: int | None  # "Tried to allocate ..."
    message_device_total_bytes: int | None  # "total capacity of ..."
    message_device_free_bytes: int | None  # "of which ... is free"
    message_process_in_use_bytes: int | None  # "this process has ... memory in use"
    message_pytorch_allocated_bytes: int | None  # "... is allocated by PyTorch"
    message_reserved_unallocated_bytes: int | None  # "... is reserved by PyTorch but unallocated"


class FootprintRowDict(TypedDict):
    """One ``(category, dtype, device)`` group of model and optimizer tensors."""

    category: str  # "parameters", "buffers", "gradients" or "optimizer_states"
    dtype: str
    device: str
    num_tensors: int
    bytes: int


class LiveTensorDict(TypedDict):
    """One of the largest live tensors on the device."""

    name: str | None  # owner's name ("layer.weight", "layer.weight (exp_avg)"), None if not owned
    shape: list[int]
    dtype: str
    device: str
    bytes: int  # storage bytes
    requires_grad: bool
    has_grad_fn: bool  # carries autograd history


class HoldersSection(TypedDict, total=False):
    """``holders``: who holds the device's memory."""

    device: Required[str]
    bytes_by_category: dict[str, int]  # parameters, buffers, gradients, optimizer_states on `device`
    rows: list[FootprintRowDict]  # the same by dtype and device, all devices
    unexplained_bytes: int | None  # allocated minus the above: activations and temporaries
    top_tensors: list[LiveTensorDict]  # the `max_listed` largest live tensors on `device`


class CheckpointingState(TypedDict, total=False):
    """``config.activation_checkpointing``: whether activation checkpointing is on, and where."""

    on: Required[bool]
    wrapped: Required[list[str]]  # modules wrapped by `GradientCheckpointing` (the first 20)
    model_switch: Required[list[str]]  # modules with `gradient_checkpointing = True` (the first 20)
    num_wrapped: Required[int]
    num_model_switch: Required[int]
    seen: str  # "at train start": on then, given back by its callback before the report


class ConfigSection(TypedDict, total=False):
    """``config``: the trainer's settings, the allocator settings, versions and activation checkpointing."""

    precision: str
    accumulate_grad_batches: int
    micro_batch_size: int | None
    effective_batch_size: int | None  # batch (AutoMicroBatch: the whole one) x world size (x accumulation in training)
    strategy: str  # class name
    accelerator: str  # class name
    num_devices: int
    num_nodes: int
    device_ids: str
    allocator: dict[str, str | None]  # PYTORCH_ALLOC_CONF, PYTORCH_CUDA_ALLOC_CONF, PYTORCH_HIP_ALLOC_CONF
    versions: dict[str, str | None]  # python, platform, torch, cuda, hip, lightning, torchmetrics, lightning_memopt
    activation_checkpointing: CheckpointingState


class ShardingSection(TypedDict, total=False):
    """``sharding``: how the model's parameters are sharded on the failing rank (FSDP2 ``fully_shard``, FSDP1)."""

    sharded: Required[bool]
    kind: str | None  # "fsdp2", "fsdp1" or None
    strategy: str | None  # the trainer's strategy class name
    data_parallel_size: int | None  # ranks the parameters are sharded over
    mesh_shape: list[int]  # shape of the parameters' device mesh
    num_parameters: int
    num_dtensor_parameters: int  # parameters that are DTensors (FSDP2's shards)
    num_units: int  # fully_shard (or FSDP1) units
    unit_names: list[str]  # their qualified names, "" for the model itself
    reshard_after_forward: bool | None  # every inner unit frees its gathered parameters after forward
    kept_unsharded: list[str]  # inner units with reshard_after_forward=False
    cpu_offload: bool | None  # a unit offloads its parameters to the CPU
    param_dtype: str | None  # MixedPrecisionPolicy.param_dtype of the units
    local_parameter_bytes: int  # this rank's parameter bytes (shards; whole where gathered at the failure)
    unsharded_parameter_bytes: int  # the whole parameters' bytes


class Suggestion(TypedDict):
    """One entry of ``suggestions``."""

    rank: int  # 1 = try first
    action: str  # what to change
    why: str  # the numbers that point to it
    saves_bytes: int | None  # rough estimate of the memory it frees


class SnapshotSection(TypedDict, total=False):
    """``snapshot``: the allocator snapshot (``record_history=True``); ``path`` is ``None`` when none was written."""

    path: Required[str | None]
    how_to_open: str  # when written
    reason: str  # when not written


class OOMReport(TypedDict, total=False):
    """The report ``OOMReporter`` writes as ``oom_report_rank{r}.json``, keys in this order."""

    format: Required[str]  # REPORT_FORMAT
    when: Required[WhenSection]
    error: Required[ErrorSection]
    batch: Required[BatchSection]
    memory: Required[MemorySection]
    holders: Required[HoldersSection]
    config: Required[ConfigSection]
    sharding: ShardingSection  # how the model is sharded
    hparams: dict[str, Any]  # the module's `hparams` as JSON values
    environment: dict[str, str]  # allow-listed environment variables
    suggestions: list[Suggestion]
    snapshot: Required[SnapshotSection]
    report_errors: Required[list[str]]  # "<part>: <error>" for each part that could not be gathered
