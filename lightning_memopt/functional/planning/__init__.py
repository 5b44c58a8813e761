"""Byte accounting of a training step without the memory: a live-storage counter over fake CPU tensors.

The engine behind :func:`lightning_memopt.estimate_memory`. A twin of the model is built on fake tensors
(``torch._subclasses.fake_tensor.FakeTensorMode``: shapes, dtypes and strides, no data), training steps run on it in
Lightning's order (:func:`count_training_steps`, in ``steps.py``; evaluation steps: :func:`count_evaluation_steps`),
and :class:`LiveBytes` (``counter.py``) adds a storage's bytes when it first appears and subtracts them when the
storage is freed. Values that depend on no data are computed beside the fake ones (``known_values.py``), so checks
on them get the real answer. On CPU this counts the same bytes
a real step holds (the tests compare with the same counter over real tensors, and with torch's ``MemTracker``); the
few kernels whose fake implementation returns fewer bytes than the real one (oneDNN's LSTM workspace, the float32
statistics of mixed-precision normalizations) are corrected in ``corrections.py`` (:func:`fake_kernel_outputs`, with
the list); what CUDA does differently is modelled in ``cuda.py`` (:func:`cuda_autocast`, :func:`cuda_dropout`,
:func:`use_foreach`, the allocator's 512-byte blocks, cuBLAS workspaces), ``attention.py`` (:func:`attention_kernel`
and :func:`cuda_attention`) and ``corrections.py`` (cuDNN's RNN reserve) and listed in the estimate's ``assumptions``.

Nothing here imports Lightning: the step is given as plain callables.
"""

from lightning_memopt.functional.planning.attention import attention_assumption, attention_kernel, cuda_attention
from lightning_memopt.functional.planning.corrections import (
    cudnn_rnn_reserve_bytes,
    fake_kernel_outputs,
    onednn_lstm_workspace_bytes,
)
from lightning_memopt.functional.planning.counter import LiveBytes, kernel_scratch
from lightning_memopt.functional.planning.cuda import (
    CUBLAS_WORKSPACE_BYTES,
    CUDA_AUTOCAST_FP32,
    CUDA_BLOCK_BYTES,
    DEFAULT_COMPUTE_CAPABILITY,
    cuda_autocast,
    cuda_dropout,
    use_foreach,
)
from lightning_memopt.functional.planning.steps import (
    PEAK_PARTS,
    FakeStepError,
    StepCount,
    count_evaluation_steps,
    count_training_steps,
    fake_tensor_of,
    fake_twin,
)

__all__ = [
    "CUDA_BLOCK_BYTES",
    "CUBLAS_WORKSPACE_BYTES",
    "CUDA_AUTOCAST_FP32",
    "DEFAULT_COMPUTE_CAPABILITY",
    "PEAK_PARTS",
    "FakeStepError",
    "LiveBytes",
    "StepCount",
    "attention_assumption",
    "attention_kernel",
    "count_evaluation_steps",
    "count_training_steps",
    "cuda_attention",
    "cuda_autocast",
    "cuda_dropout",
    "cudnn_rnn_reserve_bytes",
    "fake_kernel_outputs",
    "fake_tensor_of",
    "fake_twin",
    "kernel_scratch",
    "onednn_lstm_workspace_bytes",
    "use_foreach",
]
