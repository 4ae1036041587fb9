"""Let numba-cuda compile where NVRTC is missing but libNVVM + libdevice are present.

numba-cuda generates PTX with libNVVM; it touches NVRTC only to list supported
architectures, and its toolkit-path lookup fails as a whole when NVRTC is absent (the
case on images that carry only the ``nvidia-nvvm``/``nvidia-cuda-nvcc`` pieces).
``ensure_toolchain`` leaves a working setup alone; otherwise it fills numba-cuda's path
cache without NVRTC and pins the target architecture (``NUMBA_FORCE_CUDA_CC``) so the
NVRTC query is skipped. Installing NVRTC (``nvidia-cuda-nvrtc`` for CUDA 13,
``nvidia-cuda-nvrtc-cu12`` for CUDA 12) makes this a no-op.
"""
from __future__ import annotations

from typing import Optional

_done = False


def _paths_without_nvrtc(first_error: Exception) -> dict:
    from numba.cuda import cuda_paths

    try:
        paths = {
            "nvrtc": cuda_paths._env_path_tuple("unavailable", None),
            "nvvm": cuda_paths._get_nvvm_path(),
            "libdevice": cuda_paths._get_libdevice_path(),
            "cudalib_dir": cuda_paths._get_cudalib_dir(),
            "static_cudalib_dir": cuda_paths._get_static_cudalib_dir(),
            "include_dir": cuda_paths._get_include_dir(),
        }
    except Exception as exc:
        raise RuntimeError(f"libNVVM/libdevice not found ({exc}); first error: {first_error}") from exc
    if not paths["libdevice"].info:
        raise RuntimeError("libdevice.10.bc not found (set CUDA_HOME)")
    return paths


def ensure_toolchain(cc: Optional[tuple[int, int]] = None) -> None:
    """Idempotent. ``cc``: architecture to pin when NVRTC is missing (default: the current
    device's). Raises RuntimeError with a reason when libNVVM or libdevice is missing."""
    global _done
    if _done:
        return
    from numba.cuda import config, cuda_paths

    try:
        cuda_paths.get_cuda_paths()
        from numba.cuda.cudadrv import nvrtc

        nvrtc.get_supported_ccs()
    except Exception as exc:
        if not hasattr(cuda_paths.get_cuda_paths, "_cached_result"):
            cuda_paths.get_cuda_paths._cached_result = _paths_without_nvrtc(exc)
        if config.FORCE_CUDA_CC is None:
            if cc is None:
                from numba import cuda

                cc = tuple(cuda.get_current_device().compute_capability)
            config.FORCE_CUDA_CC = tuple(cc)
    _done = True
