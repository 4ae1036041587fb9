"""``kvpage serve``: the OpenAI-compatible server, taking vLLM's flags.

vLLM's classic command line works word for word (``--enable-chunked-prefill True``,
``--model MODEL``). User errors end as one line on stderr: exit 2 for a bad command line
(with ``serve``'s usage), 1 for a model or engine that cannot start; ``--log-level debug``
shows the traceback too. What happens at start-up lives in ``kvpage.entrypoints.cli.serve_startup``.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Optional

from kvpage.entrypoints.cli.args import (AUTO_STEP_TARGET, DefaultsHelpFormatter, UsageError, non_negative_float, port,
                                         positive_float, positive_int, step_target)
from kvpage.core.config import DEFAULT_DISK_CACHE_GIB, LINEAR_COMPUTE_DTYPES, EngineConfig
from kvpage.core.kv_formats import KV_CACHE_DTYPES
from kvpage.core.kv_events import KVEventsConfig

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
DEFAULT_MODEL = "smollm2-135m"
DTYPES = ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16", "half")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def parse_bytes(text: str) -> int:
    """``"4GiB"``, ``"512M"``, ``"1000000"`` -> bytes (binary multiples for K/M/G/T)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 4GiB, 512M, 1000000)")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * (1024 ** "_kmgt".index(unit) if unit else 1))


def positive_bytes(text: str) -> int:
    """:func:`parse_bytes` of a size of at least one byte."""
    size = parse_bytes(text)
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size of at least one byte")
    return size


def kv_events_config(text: str) -> KVEventsConfig:
    """vLLM's ``--kv-events-config`` JSON object."""
    try:
        return KVEventsConfig.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_device(text: str) -> str:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N``."""
    if text in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", text):
        return text
    raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from auto, cpu, cuda, cuda:N)")


def add_serve_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description="Serve a Hugging Face model over an OpenAI-compatible HTTP API (vLLM's flags).",
                       formatter_class=DefaultsHelpFormatter, allow_abbrev=False)
    _model_flags(p)
    _engine_flags(p)
    _server_flags(p)
    _ray_flags(p)
    p.set_defaults(func=run_serve, subparser=p)
    return p


def _model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help=f"local HF model folder or alias; default {DEFAULT_MODEL} (the embedded SmolLM2)")
    p.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                   help="the same as the positional MODEL (vLLM's spelling); give one of the two")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="weights and KV dtype; auto is bfloat16 on CPUs with bf16 instructions (float32 for a "
                        "float16 model), else float32, and float16 on GPU")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="how the KV cache stores keys and values: auto (the model's dtype), an unquantized dtype, "
                        "or fp8 (= fp8_e4m3), fp8_e5m2, int8, int4 with per-token scales (about 2x or 3.2x the "
                        "tokens of bf16 in one budget)")
    p.add_argument("--device", type=parse_device, default="auto", metavar="{auto,cpu,cuda,cuda:N}",
                   help="where the model runs; auto takes a CUDA device when there is one")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="names the API answers to (default: MODEL as given)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampler's shared random stream")


def _engine_flags(p: argparse.ArgumentParser) -> None:
    bool_flag = argparse.BooleanOptionalAction
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (a power of two)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one step")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    p.add_argument("--max-step-ms", type=step_target, default=AUTO_STEP_TARGET, metavar="MS|auto|off",
                   help="target duration of a step while streams are decoding: prompt chunks get the tokens "
                        "that the step cost measured on this machine leaves after the decodes (at least one "
                        "block, at most --max-num-batched-tokens), which bounds inter-token latency; steps "
                        "without decodes keep the full budget; 'auto': six times the decodes' own cost, at least "
                        "50 ms; 'off': the static budget alone (default: auto with chunked prefill, else off)")
    p.add_argument("--enable-chunked-prefill", action=bool_flag, default=True,
                   help="split long prompts into chunks that share steps with decodes; takes an optional value")
    p.add_argument("--enable-prefix-caching", action=bool_flag, default=True,
                   help="reuse the KV of shared prompt prefixes; takes an optional value")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of GPU memory for weights, activations and KV (GPU only; ignored on CPU)")
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                   help="KV budget in bytes, e.g. 2GiB (wins over --gpu-memory-utilization)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (wins over every budget)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest sequence, prompt + output, in tokens (default: the model's limit)")
    p.add_argument("--attention-backend", default="auto", help="a registered attention backend: auto, cpu, cuda, "
                   "reference")
    p.add_argument("--exact", action=bool_flag, default=False,
                   help="greedy output identical to HF generate: eager, torch's linears (default: the fast "
                   "mode, compiled with oneDNN linears on CPU); takes an optional value")
    p.add_argument("--batch-invariant", action=bool_flag, default=False,
                   help="every request's output bit for bit the same whatever shares its steps and however it "
                   "was scheduled (chunks, prefix hits, preemption): the exact mode, with linears in fixed row "
                   "tiles and every attention row through the prompt kernel; CPU only, slower; takes an "
                   "optional value")
    p.add_argument("--enforce-eager", action=bool_flag, default=None,
                   help="run the model op by op, without graph compilation or CUDA graphs (default: "
                   "compiled on CPU, cached on disk; on GPU eager ops with decode steps replayed from CUDA "
                   "graphs; eager with --exact); takes an optional value")
    p.add_argument("--onednn-linears", action=bool_flag, default=None,
                   help="CPU: run the linears through oneDNN (default: on, off with --exact; greedy results "
                   "may then depend on batch composition at float rounding level); takes an optional value")
    p.add_argument("--linear-compute-dtype", choices=LINEAR_COMPUTE_DTYPES, default="auto",
                   help="CPU, bf16/fp16 models: the dtype the oneDNN linears compute in (default auto: float32 "
                   "where it is measured faster at load, as on AVX-512 CPUs without AMX; float32 implies "
                   "--onednn-linears)")
    p.add_argument("--num-threads", type=int, default=None,
                   help="compute threads for torch and numba (default: the CPUs this process may use)")
    p.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                   help="keep sliding-window layers' KV for the whole context (one KV group, as in models "
                        "without sliding windows); the KV tiers imply it")
    _tier_flags(p)


def _tier_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-offloading-size", type=positive_float, default=None, metavar="GiB",
                   help="host memory for KV blocks evicted from the pool, in GiB (vLLM's flag); hits load them back")
    p.add_argument("--kv-disk-cache", default=None, metavar="DIR",
                   help="directory of a disk KV tier that persists across restarts (write-through)")
    p.add_argument("--kv-disk-cache-size", type=positive_float, default=None, metavar="GiB",
                   help=f"size cap of --kv-disk-cache in GiB (default {DEFAULT_DISK_CACHE_GIB:g}); LRU beyond it")
    p.add_argument("--kv-events-config", type=kv_events_config, default=None, metavar="JSON",
                   help='publish KV events as vLLM does, e.g. \'{"enable_kv_cache_events": true, "publisher": "zmq", '
                        '"endpoint": "tcp://*:5557", "topic": "kv"}\'')


def _server_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=port, default=8000, help="TCP port to bind")
    p.add_argument("--api-key", default=None, help="require Authorization: Bearer <key> on /v1/*")
    p.add_argument("--max-waiting", type=positive_int, default=1024, help="waiting-queue bound; past it requests get 503")
    p.add_argument("--max-body-bytes", type=positive_bytes, default=1 << 20, help="largest request body; past it, 413")
    p.add_argument("--max-tokens-cap", type=positive_int, default=4096, help="largest max_tokens a request may ask for")
    p.add_argument("--max-request-seconds", type=positive_float, default=None,
                   help="deadline of every request, from arrival; past it the request ends with "
                        "finish_reason 'length'; a request's own 'timeout' field may shorten it (default: none)")
    p.add_argument("--stats-interval-s", type=non_negative_float, default=10.0,
                   help="seconds between the stats log lines; 0 disables them")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                   help="log level of kvpage and uvicorn; debug also shows tracebacks of start-up errors")


def _ray_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=positive_int, default=None,
                   help="serve N engine replicas on Ray Serve behind prefix-aware routing (needs kvpage[ray]); "
                        "default: one engine in this process, without Ray")
    p.add_argument("--router", choices=("prefix", "default"), default="prefix",
                   help="with --replicas: prefix-aware routing, or Ray Serve's default power-of-two-choices")
    p.add_argument("--ray-address", default=None,
                   help="with --replicas: the Ray cluster to join (e.g. auto); default: start a local one")
    p.add_argument("--replica-num-cpus", type=positive_float, default=1.0,
                   help="with --replicas: CPUs Ray reserves for each replica")


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The ``EngineConfig`` named by the parsed flags (each flag is a field of the same name).

    Raises ``UsageError`` for a value the config refuses (a bad block size, ...).
    """
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)}
    if values.get("max_step_ms") is AUTO_STEP_TARGET:  # the default follows chunked prefill
        values["max_step_ms"] = "auto" if values.get("enable_chunked_prefill", True) else None
    try:
        return EngineConfig(**values)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def model_of(args: argparse.Namespace) -> str:
    """The model named positionally or by ``--model``; both and different is a ``UsageError``."""
    positional, flag = args.model, args.model_flag
    if positional is not None and flag is not None and positional != flag:
        raise UsageError(f"two models given: {positional!r} (positional) and {flag!r} (--model); give one")
    return flag or positional or DEFAULT_MODEL


def run_serve(args: argparse.Namespace) -> Optional[int]:
    if getattr(args, "replicas", None) is not None:
        from kvpage.entrypoints.cli.serve_ray import serve_on_ray

        return serve_on_ray(args, model_of(args), config_from_args(args))
    from kvpage.entrypoints.cli.serve_startup import serve

    return serve(args, model_of(args), config_from_args(args))
