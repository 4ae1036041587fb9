"""Launch buffers kept across ``paged_attention`` calls, one set per (device, stream).

What a launch needs but does not read back (the fast decode's partials and counters, the
1-element stand-ins for absent sinks and partials) is allocated once, as Numba device arrays
(host numpy under the simulator), and handed out as kernel arguments. Reuse is safe because
every launch that touches a set runs on that set's stream, so launches using it are ordered.

Contracts:

* ``floats(shapes)``: fp32 views of one growing buffer, contents undefined; valid until the
  next ``floats`` call of a larger total size on the same set.
* ``counters(shape)``: an int32 view of a buffer that is zero before the first launch; every
  user must leave it zero (the fast decode kernel does).
* ``dummy(ndim)``: a 1-element-per-axis fp32 array of rank ``ndim``, never written.
"""
from __future__ import annotations

from math import prod
from typing import Any, Optional

import numpy as np

from .interop import CUPY, TORCH, simulator_enabled

#: Shape-keyed views kept per set before the cache starts over (batch sizes vary per step).
MAX_VIEWS = 256


class Workspace:
    """One (device, stream)'s reusable launch buffers (see the module docstring)."""

    def __init__(self, device: Optional[int], stream: Any) -> None:
        self.device, self.stream = device, stream
        self._floats, self._counters = None, None
        self._views: dict[tuple, tuple] = {}
        self._dummies = tuple(self._alloc(np.empty((1,) * ndim, np.float32)) for ndim in (1, 2, 3, 4))

    def _alloc(self, host: np.ndarray) -> Any:
        """``host`` itself in the simulator, else a device copy queued on this set's stream."""
        if simulator_enabled():
            return host
        from numba import cuda

        if self.device is None:
            return cuda.to_device(host, stream=self.stream)
        with cuda.gpus[self.device]:
            return cuda.to_device(host, stream=self.stream)

    def floats(self, shapes: tuple[tuple[int, ...], ...]) -> tuple:
        """fp32 arrays of ``shapes``, packed one after another in the set's float buffer."""
        key = ("f", shapes)
        views = self._views.get(key)
        if views is None:
            sizes = [prod(s) for s in shapes]
            old = 0 if self._floats is None else self._floats.shape[0]
            if old < sum(sizes):
                self._floats = self._alloc(np.zeros(max(sum(sizes), 2 * old), np.float32))
                self._views.clear()  # views of the old buffer must not be handed out again
            offsets = np.cumsum([0, *sizes]).tolist()
            views = tuple(self._floats[a:b].reshape(s) for a, b, s in zip(offsets, offsets[1:], shapes))
            self._remember(key, views)
        return views

    def counters(self, shape: tuple[int, ...]) -> Any:
        """An int32 array of ``shape``, zero at the first launch and kept zero by its users."""
        key = ("c", shape)
        view = self._views.get(key)
        if view is None:
            size = prod(shape)
            if self._counters is None or self._counters.shape[0] < size:
                old = 0 if self._counters is None else self._counters.shape[0]
                self._counters = self._alloc(np.zeros(max(size, 2 * old, 1024), np.int32))
                self._views = {k: v for k, v in self._views.items() if k[0] != "c"}
            view = self._counters[:size].reshape(shape)
            self._remember(key, view)
        return view

    def dummy(self, ndim: int) -> Any:
        return self._dummies[ndim - 1]

    def _remember(self, key: tuple, value: Any) -> None:
        if len(self._views) >= MAX_VIEWS:
            self._views.clear()
        self._views[key] = value


_SETS: dict[tuple, Workspace] = {}


def array_device(x: Any, kind: str) -> Optional[int]:
    """The CUDA device index of a CuPy or torch array; None (the current device) otherwise."""
    if kind == TORCH:
        return x.get_device()
    if kind == CUPY:
        return x.device.id
    return None


def workspace(device: Optional[int], stream: Any) -> Workspace:
    """The buffer set of ``device`` (None: the current one) and a Numba ``stream`` (0 in the simulator)."""
    key = (device, int(stream))
    found = _SETS.get(key)
    if found is None:
        found = _SETS[key] = Workspace(device, stream)
    return found
