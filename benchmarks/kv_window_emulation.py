"""What a full-precision window of recent tokens would buy a quantized KV cache, emulated in HF attention.

KIVI keeps the most recent tokens' keys and values unquantized. kvpage's blocks hold only
quantized rows, so such a window would be a second store that every kernel reads; this
script measures, before anything is built, how much perplexity the window would give back.

Run (SmolLM2-135M in float32, the prose windows of ``benchmarks/bench_kv_quality.py``)::

    python benchmarks/kv_window_emulation.py                         # int4; windows 0, 1, 4, 16
    python benchmarks/kv_window_emulation.py --format fp8_e4m3 --windows 0 4 --own-block 16

Each layer's attention (registered through transformers' ``AttentionInterface``) scores
every query against two copies of its keys and values: the model's own and the format's
round trip (Hadamard-rotated when the format stores rows rotated, then quantized and read
back with :mod:`kvpage.kernels.kv_quant`, the definition of the bytes). Query ``p`` reads key
``j`` at full precision when ``p - j < W`` (``--windows``) or, with ``--own-block B``, when
``j`` lies in ``p``'s block of ``B`` tokens; every other key through the format. Window 0 is
the plain format. Deterministic: no timing, so a busy machine changes nothing.
"""
from __future__ import annotations

import argparse
import math


def round_trip(x, fmt):
    """``x [B, H, T, D]`` through ``fmt``'s bytes and back (rotated like the cache's rows)."""
    import torch

    from kvpage.attention.kv_rotation import hadamard_rotation
    from kvpage.kernels import kv_quant

    values = x.float()
    rotation = torch.from_numpy(hadamard_rotation(int(x.shape[-1]))) if fmt.rotated else None
    if rotation is not None:
        values = values @ rotation
    codes, scales = kv_quant.quantize_rows(values.numpy(), fmt)
    back = torch.from_numpy(kv_quant.dequantize_rows(codes, scales, fmt))
    if rotation is not None:
        back = back @ rotation  # R is symmetric and orthonormal: its own inverse
    return back.to(x.dtype)


def full_precision_mask(length: int, window: int, own_block: int):
    """``[T, T]`` bool: query ``p`` reads key ``j`` unquantized (keys after ``p`` are
    masked by causality, not here)."""
    import torch

    pos = torch.arange(length)
    if own_block:
        return (pos[:, None] // own_block) == (pos[None, :] // own_block)
    return (pos[:, None] - pos[None, :]) < window


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--format", default="int4", help="a quantized kv_cache_dtype")
    parser.add_argument("--windows", type=int, nargs="+", default=[0, 1, 4, 16],
                        help="recent positions (the query's own included) read at full precision")
    parser.add_argument("--own-block", type=int, default=0, help="also measure this block size's own-block window")
    parser.add_argument("--window", type=int, default=1024, help="tokens per scored text window")
    parser.add_argument("--skip", type=int, default=2, help="leading text windows left out")
    parser.add_argument("--max-windows", type=int, default=19)
    args = parser.parse_args(argv)

    import torch
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

    from kvpage.core.kv_formats import resolve_kv_format
    from kvpage.platform.model_registry import resolve_model_path
    from kvpage.tools.kv_quality import english_prose, text_windows

    fmt = resolve_kv_format(args.format, "float32")
    if not fmt.quantized:
        parser.error(f"--format {args.format} is not a quantized format")
    path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    windows = text_windows(tokenizer, english_prose(), args.window, args.max_windows)[args.skip:]
    mode: dict = {"window": None, "own_block": 0}

    def attention(module, q, k, v, mask, scaling=None, **kwargs):
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
        length = q.shape[2]
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        scores = (q @ k.transpose(-1, -2)) * scaling
        if mode["window"] is None:  # the model's own cache
            probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)
            return (probs @ v).transpose(1, 2), None
        full = full_precision_mask(length, mode["window"], mode["own_block"])
        kq, vq = round_trip(k, fmt), round_trip(v, fmt)
        scores = torch.where(full, scores, (q @ kq.transpose(-1, -2)) * scaling)
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)
        return (torch.where(full, probs, 0) @ v + torch.where(full, 0, probs) @ vq).transpose(1, 2), None

    AttentionInterface.register("kv_window_emulation", attention)
    model.set_attn_implementation("kv_window_emulation")

    @torch.no_grad()
    def perplexity() -> float:
        nll, count = 0.0, 0
        for ids in windows:
            tokens = torch.tensor([ids])
            logits = model(tokens).logits[0, :-1].float()
            nll -= torch.log_softmax(logits, -1).gather(1, tokens[0, 1:, None]).sum().item()
            count += len(ids) - 1
        return math.exp(nll / count)

    base = perplexity()
    print(f"{args.model}, float32, {len(windows)} windows of {args.window} tokens; model's own cache: {base:.4f}")
    runs = [(f"last {w}" if w else f"plain {args.format}", w, 0) for w in args.windows]
    if args.own_block:
        runs.append((f"own block of {args.own_block}", 0, args.own_block))
    for label, window, own_block in runs:
        mode.update(window=window, own_block=own_block)
        value = perplexity()
        print(f"{label:>18}: {value:.4f}  {100 * (value / base - 1):+.2f} %", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
