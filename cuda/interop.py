"""Array and stream interop for the launch wrappers: CuPy, torch and Numba device arrays.

Device arrays are passed to kernels zero-copy through ``__cuda_array_interface__``.
Launches go on the caller's current stream (CuPy's or torch's), so nothing here
synchronises. Under the Numba CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) kernels take
host numpy arrays directly.

torch and cupy are never imported here: an array's library is read from
``type(x).__module__`` and the already-imported module is taken from ``sys.modules``.
"""
from __future__ import annotations

import glob
import shutil
import sys
from typing import Any, Optional

import numpy as np

NUMPY, CUPY, TORCH, NUMBA = "numpy", "cupy", "torch", "numba"


def simulator_enabled() -> bool:
    """True when numba.cuda runs the simulator (decided when numba.cuda was first imported)."""
    from numba import config

    return bool(config.ENABLE_CUDASIM)


def gpu_present() -> bool:
    """True when this machine shows an NVIDIA GPU: a ``/dev/nvidia*`` node or ``nvidia-smi``."""
    return bool(glob.glob("/dev/nvidia*")) or shutil.which("nvidia-smi") is not None


def gpu_unavailable_reason() -> Optional[str]:
    """Why real-GPU work cannot run here (None when a CUDA device is usable through CuPy).

    "no GPU" when the machine shows none; a driver or runtime problem is reported only when
    there is a GPU to have one.
    """
    if not gpu_present():
        return "no GPU (no /dev/nvidia* device and no nvidia-smi)"
    if simulator_enabled():
        return "NUMBA_ENABLE_CUDASIM=1: real-GPU work needs the real driver"
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken CUDA runtime
        return f"a GPU is present but CUDA is unusable: {exc}"
    return None


def array_kind(x: Any) -> str:
    """Which library ``x`` belongs to; raises ValueError for anything unsupported."""
    if isinstance(x, np.ndarray):
        return NUMPY
    mod = type(x).__module__.split(".")[0]
    if mod == "cupy":
        return CUPY
    if mod == "torch":
        if not x.is_cuda:
            raise ValueError("torch tensors must live on a CUDA device (got a CPU tensor)")
        return TORCH
    if hasattr(x, "__cuda_array_interface__"):
        return NUMBA
    raise ValueError(f"unsupported array type {type(x).__name__}: expected numpy, CuPy, torch or Numba device array")


def numpy_dtype(x: Any) -> np.dtype:
    """numpy dtype of any supported array (torch dtypes mapped through their name)."""
    if array_kind(x) == TORCH:
        name = str(x.dtype).replace("torch.", "")
        if name == "bfloat16":
            raise ValueError("bfloat16 is not supported by the Numba CUDA kernels (fp16/fp32 only)")
        return np.dtype(name)
    return np.dtype(x.dtype)


#: Kernel-argument views kept per process before the cache starts over (``as_kernel_arg``).
MAX_ARG_VIEWS = 4096
_ARG_VIEWS: dict = {}
_STREAMS: dict = {}


def _layout_key(x: Any, kind: str) -> Optional[tuple]:
    """What a zero-copy view of ``x`` depends on: its device, address, shape, strides and
    dtype (None for a library whose arrays are not cached)."""
    if kind == TORCH:
        return (TORCH, x.get_device(), x.data_ptr(), tuple(x.shape), x.stride(), x.dtype)
    if kind == CUPY:
        return (CUPY, x.device.id, x.data.ptr, x.shape, x.strides, x.dtype.str)
    return None


def as_kernel_arg(x: Any, stream: Any = 0) -> Any:
    """A kernel argument for ``x``: zero-copy view of device arrays; host numpy arrays are
    copied to the device (asynchronously on ``stream``), or passed as-is in the simulator.

    Views of torch and CuPy arrays are cached by layout (``_layout_key``) and own nothing:
    a view is a pointer with a shape, equally valid for any array later allocated at the
    same address with the same layout, and it never keeps an array alive. Making one costs
    Numba tens of microseconds (a driver query among them), paid per layer and call
    otherwise; a step's KV caches, and mostly its q and outputs, repeat their layouts."""
    from numba import cuda

    if simulator_enabled():
        return x  # the simulator's kernels index host arrays directly
    if isinstance(x, np.ndarray):
        return cuda.to_device(np.ascontiguousarray(x), stream=stream)
    key = _layout_key(x, array_kind(x))
    if key is None:
        # sync=False: the launch goes on the caller's stream, which already orders it after
        # the producer; Numba's default would block the host on the array's exported stream.
        return cuda.as_cuda_array(x, sync=False)
    view = _ARG_VIEWS.get(key)
    if view is None:
        view = _zero_copy_view(x)
        if len(_ARG_VIEWS) >= MAX_ARG_VIEWS:
            _ARG_VIEWS.clear()
        _ARG_VIEWS[key] = view
    return view


def _zero_copy_view(x: Any) -> Any:
    """A Numba device array over ``x``'s memory that does not own it (nor keep ``x`` alive)."""
    from numba import cuda

    return cuda.from_cuda_array_interface(x.__cuda_array_interface__, owner=None, sync=False)


def _external_stream(handle: int) -> Any:
    """Numba's stream object for a raw ``cudaStream_t``, made once per handle."""
    from numba import cuda

    found = _STREAMS.get(handle)
    if found is None:
        if len(_STREAMS) >= MAX_ARG_VIEWS:
            _STREAMS.clear()
        found = _STREAMS[handle] = cuda.external_stream(handle)
    return found


def resolve_stream(stream: Optional[Any], arrays: tuple) -> Any:
    """The Numba stream to launch on.

    ``stream`` may be a Numba stream, a CuPy stream (``.ptr``), a torch stream
    (``.cuda_stream``) or a raw ``cudaStream_t`` int. ``None`` means the current stream of
    the library that owns the arrays (torch first, then CuPy), else Numba's default stream.
    """
    from numba import cuda

    if simulator_enabled():
        return 0
    if stream is None:
        kinds = {array_kind(a) for a in arrays if a is not None}
        if TORCH in kinds:
            stream = sys.modules["torch"].cuda.current_stream()
        elif CUPY in kinds:
            stream = sys.modules["cupy"].cuda.get_current_stream()
        else:
            return cuda.default_stream()
    if isinstance(stream, int):
        return _external_stream(stream) if stream else cuda.default_stream()
    if hasattr(stream, "cuda_stream"):  # torch.cuda.Stream
        return _external_stream(stream.cuda_stream) if stream.cuda_stream else cuda.default_stream()
    if hasattr(stream, "ptr") and type(stream).__module__.startswith("cupy"):
        return _external_stream(stream.ptr) if stream.ptr else cuda.default_stream()
    return stream  # already a numba stream


def empty_like_kind(like: Any, shape: tuple, dtype: Any, stream: Any = 0) -> Any:
    """Uninitialised array from the allocator of ``like``'s library, on ``like``'s device
    (CuPy's and torch's pools are stream-ordered; numpy maps to a Numba device array, or
    to numpy under the simulator)."""
    dtype = np.dtype(dtype)
    kind = array_kind(like)
    if kind == CUPY:
        cupy = sys.modules["cupy"]
        with like.device:
            return cupy.empty(shape, dtype=dtype)
    if kind == TORCH:
        torch = sys.modules["torch"]
        return torch.empty(shape, dtype=getattr(torch, dtype.name), device=like.device)
    if kind == NUMPY and simulator_enabled():
        return np.empty(shape, dtype=dtype)
    from numba import cuda

    return cuda.device_array(shape, dtype=dtype, stream=stream)
