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

**The compute dtype.** A half-precision model's linears may compute in float32: the
reordered copy is then the weight widened to float32, and each ``OneDnnLinear`` widens its
input and rounds its output back to the model's dtype. The casts are outside the op, so
that a compiled graph fuses them into the neighbouring elementwise kernels (measured 1.10x
offline against casts inside the op; ``graph_passes`` merges siblings' casts of one input).
A product of two bf16 (or fp16) values is exact in float32 and oneDNN's half-precision
matmul accumulates in float32 too, so the widened matmul is the same sum of the same
products, in another order. Where a CPU's half-precision
matmul is slower than its float32 one (AVX-512 without AMX: oneDNN's bf16 kernels run at
about half the float32 rate there), the wide matmul is the faster one, at the price of a
copy twice the size (``pick_compute_dtype`` measures both on the model's own weight and
weighs the memory; docs/performance.md has the figures).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from kvpage.core.config import LINEAR_COMPUTE_DTYPES
from kvpage.storage.sizing import free_ram_bytes


@dataclass(frozen=True)
class Packed:
    """A weight's oneDNN-reordered copy and its bias, both at the dtype the matmul runs in."""

    weight: torch.Tensor
    bias: Optional[torch.Tensor]

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype


def _run(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """oneDNN's matmul of ``x`` by a reordered weight, computed at the weight's dtype and
    returned at ``x``'s."""
    if packed.dtype == x.dtype:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return torch.ops.mkldnn._linear_pointwise(x.to(packed.dtype), packed, bias, "none", [], "").to(x.dtype)


# weight.data_ptr() -> its oneDNN-reordered copy, for every weight currently swapped.
_REORDERED: dict[int, Packed] = {}
# (member weights' data_ptrs) -> (reordered concatenation, concatenated bias or None), for
# the fused sibling linears of the compiled graph (``graph_passes``); an entry goes when
# any member is released or its address is swapped again.
_FUSED: dict[tuple[int, ...], tuple[torch.Tensor, Optional[torch.Tensor]]] = {}


def _forget_fused(weight_ptr: int) -> None:
    for key in [k for k in _FUSED if weight_ptr in k]:
        del _FUSED[key]


@torch.library.custom_op("kvpage::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through oneDNN on ``weight``'s reordered copy (the
    copy's bias, the same values, is the one used)."""
    packed = _REORDERED[weight.data_ptr()]
    return _run(x, packed.weight, packed.bias)


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
        dtype = _REORDERED[key[0]].dtype
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(torch.cat([w.detach().to(dtype) for w in weights]), None)
            bias = torch.cat([b.detach().to(dtype) for b in biases]) if biases else None
        entry = _FUSED[key] = (packed, bias)
    return entry


@torch.library.custom_op("kvpage::onednn_linear_fused", mutates_args=())
def onednn_linear_fused(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat([F.linear(x, w, b) for w, b in ...], -1)`` as one oneDNN matmul
    (``biases`` empty: none)."""
    packed, bias = fused_weight(weights, biases)
    return _run(x, packed, bias)


@onednn_linear_fused.register_fake
def _(x, weights, biases):
    return x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights)))


class OneDnnLinear(torch.nn.Module):
    """``nn.Linear``'s forward on a oneDNN-reordered weight (inference only), computed at
    ``compute_dtype`` (default: the weight's)."""

    def __init__(self, linear: torch.nn.Linear, compute_dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        dtype = self.compute_dtype = compute_dtype or linear.weight.dtype
        _forget_fused(linear.weight.data_ptr())
        with torch.no_grad():
            bias = None if linear.bias is None else linear.bias.detach().to(dtype)
            _REORDERED[linear.weight.data_ptr()] = Packed(
                torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach().to(dtype), None), bias)
        self.original = [linear]  # a list, so the original is not registered as a child module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype or torch.is_grad_enabled() and self.weight.requires_grad:
            return self.original[0](x)
        if self.compute_dtype == x.dtype:
            return onednn_linear(x, self.weight, self.bias)
        # The casts stay outside the op, so that a compiled graph fuses them into the ops
        # that make the input and use the output (graph_passes merges siblings' casts).
        return onednn_linear(x.to(self.compute_dtype), self.weight, self.bias).to(x.dtype)

    def release(self) -> None:
        _REORDERED.pop(self.weight.data_ptr(), None)
        _forget_fused(self.weight.data_ptr())


def _matmul_supported(dtype: torch.dtype) -> bool:
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float16 and torch.ops.mkldnn._is_mkldnn_fp16_supported()


def onednn_available(model: torch.nn.Module) -> bool:
    """Whether ``model``'s linears can run through oneDNN: a CPU model of float32, or of
    bf16/fp16 (which compute widened to float32 where oneDNN has no matmul of their own)."""
    param = next(model.parameters())
    return (param.device.type == "cpu" and param.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and torch.backends.mkldnn.is_available())


def _linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    return [m for m in model.modules() if type(m) is torch.nn.Linear]


def _seconds_per_matmul(weight: torch.Tensor, dtype: torch.dtype, rows: int, reps: int = 5) -> float:
    """The best of ``reps`` timed oneDNN matmuls of ``rows`` rows by ``weight`` at ``dtype``."""
    with torch.no_grad():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype), None)
        x = torch.randn(rows, weight.shape[1]).to(weight.dtype)
        _run(x, packed, None)
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            _run(x, packed, None)
            best = min(best, time.perf_counter() - start)
    return best


# Widen only for a clear win: the copy costs memory, and a near tie is noise.
_WIDEN_SPEEDUP = 1.15
# Rows of the timed matmuls: a decode step's batch and a prompt chunk's.
_TIMED_ROWS = (32, 256)


def pick_compute_dtype(model: torch.nn.Module, setting: str = "auto") -> tuple[torch.dtype, str]:
    """The dtype ``model``'s oneDNN linears compute in, and why, for ``setting``:

    - ``"model"``: the weights' dtype (a half-precision dtype oneDNN has no matmul for on
      this CPU still widens to float32: there is no other oneDNN path);
    - ``"float32"``: widened to float32;
    - ``"auto"``: float32 models stay float32; a bf16/fp16 model widens when a float32
      matmul of its widest linear runs at least 1.15x faster than one at its own dtype
      (timed here, for a decode batch and a prompt chunk, summed; the output embedding
      is not the one timed) and the float32 copies
      fit in half the memory the OS has available.

    Raises ``ValueError`` for any other setting.
    """
    if setting not in LINEAR_COMPUTE_DTYPES:
        raise ValueError(f"linear compute dtype must be one of {', '.join(LINEAR_COMPUTE_DTYPES)}; got {setting!r}")
    dtype = next(model.parameters()).dtype
    if dtype == torch.float32:
        return dtype, "the model's dtype"
    if not _matmul_supported(dtype):
        return torch.float32, f"oneDNN has no {_name(dtype)} matmul on this CPU"
    if setting != "auto":
        return (dtype, "the model's dtype") if setting == "model" else (torch.float32, "asked for")
    linears = _linears(model)
    if not linears:
        return dtype, "the model's dtype (no linears)"
    extra = sum(m.weight.numel() for m in linears) * 4  # the float32 copies, made after this
    if extra > free_ram_bytes() // 2:
        return dtype, f"float32 copies ({extra / 2**30:.1f} GiB) would not fit in half the available memory"
    # The layers' linears do most of the work; an output embedding as wide as a vocabulary
    # is a shape of its own (and near a tie at prompt rows on AVX-512 CPUs), so it is not
    # the one timed.
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    timed = [m for m in linears if m is not head] or linears
    widest = max(timed, key=lambda m: m.weight.numel()).weight
    own = sum(_seconds_per_matmul(widest, dtype, rows) for rows in _TIMED_ROWS)
    wide = sum(_seconds_per_matmul(widest, torch.float32, rows) for rows in _TIMED_ROWS)
    speedup = own / wide
    if speedup >= _WIDEN_SPEEDUP:
        return torch.float32, f"float32 matmuls measured {speedup:.2f}x faster than {_name(dtype)} on this CPU"
    return dtype, f"float32 matmuls measured {speedup:.2f}x {_name(dtype)}'s on this CPU"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def use_onednn_linears(model: torch.nn.Module, compute_dtype: Optional[torch.dtype] = None) -> Callable[[], None]:
    """Swap every ``nn.Linear`` of ``model`` for a ``OneDnnLinear`` computing at
    ``compute_dtype`` (default: the weights' dtype); returns the undo function."""
    swapped: list[tuple[torch.nn.Module, str, torch.nn.Linear]] = []
    if not onednn_available(model):
        return lambda: None
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, OneDnnLinear(child, compute_dtype))
                swapped.append((parent, name, child))

    def undo() -> None:
        for parent, name, child in swapped:
            getattr(parent, name).release()
            setattr(parent, name, child)
        swapped.clear()

    return undo
