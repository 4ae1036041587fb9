"""oneDNN linears for the model's CPU forward: the same math on a faster matmul.

torch's CPU ``F.linear`` runs float32 through MKL's sgemm, which on AMD CPUs takes a
slower code path; oneDNN's matmul over a weight reordered once into its own blocked
layout is faster in float32 and bfloat16 (docs/performance.md).

``use_onednn_linears(model)`` swaps each ``nn.Linear`` *instance* for a ``OneDnnLinear``
that keeps the original ``weight``/``bias`` parameters (so state dicts, tied weights and
``get_output_embeddings().weight`` are unchanged) plus the reordered copy; no model class
is modified. It returns a function that puts the original modules back. The reordered
copy doubles the memory of the linear weights; it is skipped where oneDNN is missing.
oneDNN also keeps an LRU cache of one compiled matmul per input shape (1024 entries, env
``LRU_CACHE_CAPACITY`` / ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` read when torch loads), so a
server's resident memory rises until that cache is full, then stays flat (a much smaller
cache keeps memory flat from the start, at a cost in throughput).

Under ``torch.compile`` the call is the custom op ``kvpage::onednn_linear`` (the reordered
weight is an opaque oneDNN tensor that dynamo cannot trace): the op takes the plain weight
and finds its reordered copy in ``_REORDERED``, keyed by the weight's storage, which lives
exactly as long as the swap.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

# weight.data_ptr() -> its oneDNN-reordered copy, for every weight currently swapped.
_REORDERED: dict[int, torch.Tensor] = {}
# (member weights' data_ptrs) -> (reordered concatenation, concatenated bias or None), for
# the fused sibling linears of the compiled graph (``graph_passes``); an entry goes when
# any member is released or its address is swapped again.
_FUSED: dict[tuple[int, ...], tuple[torch.Tensor, Optional[torch.Tensor]]] = {}


def _forget_fused(weight_ptr: int) -> None:
    for key in [k for k in _FUSED if weight_ptr in k]:
        del _FUSED[key]


@torch.library.custom_op("kvpage::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through oneDNN on ``weight``'s reordered copy."""
    return torch.ops.mkldnn._linear_pointwise(x, _REORDERED[weight.data_ptr()], bias, "none", [], "")


@onednn_linear.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def fused_weight(weights: list[torch.Tensor], biases: list[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The reordered concatenation of ``weights`` (and of ``biases``, or None), packed on
    first use: the members' weights must be swapped (``OneDnnLinear``)."""
    key = tuple(w.data_ptr() for w in weights)
    entry = _FUSED.get(key)
    if entry is None:
        if any(k not in _REORDERED for k in key):
            raise RuntimeError("a fused linear's member weight is not swapped for oneDNN")
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(torch.cat([w.detach() for w in weights]), None)
            bias = torch.cat([b.detach() for b in biases]) if biases else None
        entry = _FUSED[key] = (packed, bias)
    return entry


@torch.library.custom_op("kvpage::onednn_linear_fused", mutates_args=())
def onednn_linear_fused(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat([F.linear(x, w, b) for w, b in ...], -1)`` as one oneDNN matmul
    (``biases`` empty: none)."""
    packed, bias = fused_weight(weights, biases)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@onednn_linear_fused.register_fake
def _(x, weights, biases):
    return x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights)))


class OneDnnLinear(torch.nn.Module):
    """``nn.Linear``'s forward on a oneDNN-reordered weight (inference only)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        _forget_fused(linear.weight.data_ptr())
        with torch.no_grad():
            _REORDERED[linear.weight.data_ptr()] = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.original = [linear]  # a list, so the original is not registered as a child module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype or torch.is_grad_enabled() and self.weight.requires_grad:
            return self.original[0](x)
        return onednn_linear(x, self.weight, self.bias)

    def release(self) -> None:
        _REORDERED.pop(self.weight.data_ptr(), None)
        _forget_fused(self.weight.data_ptr())


def onednn_available(model: torch.nn.Module) -> bool:
    param = next(model.parameters())
    return (param.device.type == "cpu" and param.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available()
            and (param.dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()))


def use_onednn_linears(model: torch.nn.Module) -> Callable[[], None]:
    """Swap every ``nn.Linear`` of ``model`` for a ``OneDnnLinear``; returns the undo function."""
    swapped: list[tuple[torch.nn.Module, str, torch.nn.Linear]] = []
    if not onednn_available(model):
        return lambda: None
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, OneDnnLinear(child))
                swapped.append((parent, name, child))

    def undo() -> None:
        for parent, name, child in swapped:
            getattr(parent, name).release()
            setattr(parent, name, child)
        swapped.clear()

    return undo
