"""The KV memory plan of a model: what one token and one request cost, and how many fit.

Pure arithmetic over a ``KVCacheSpec`` (nothing is allocated), through the same functions
the engine sizes its pool with (``KVCacheSpec.kv_groups``, ``determine_num_blocks``), so
``kvpage plan`` prints the numbers the engine then uses.

Maximum concurrency at ``max_model_len`` ``N``: the requests that can all hold ``N``
tokens while decoding, after setting aside what one prefill chunk of the step's token
budget adds to the sliding groups for the duration of its step::

    max_concurrency = (num_blocks - chunk_reserve) // blocks_per_request(N)

The plan is for the spec's KV format (``kv_cache_dtype``); ``format_rows`` puts every
format side by side under the plan's byte budget.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from kvpage.core.kv.kv_groups import KVCacheGroups
from kvpage.core.kv_formats import KV_CACHE_DTYPES
from kvpage.storage.sizing import determine_num_blocks, kv_sizing_rule
from kvpage.storage.spec import KVCacheSpec


def group_rows(spec: KVCacheSpec, groups: KVCacheGroups, max_model_len: int) -> list[dict]:
    """One row per KV group: its layers and window, KV bytes per token, blocks per request."""
    # A block holds group_size layers in every group, padding positions included.
    token_bytes = spec.bytes_per_block_of(groups) // spec.block_size
    return [{"group": index, "sliding_window": group.sliding_window, "num_layers": len(group.layers),
             "layers": list(group.layers), "kv_bytes_per_token": token_bytes,
             "blocks_per_request": group.blocks_held(max_model_len, spec.block_size)}
            for index, group in enumerate(groups.groups)]


def plan_layout(spec: KVCacheSpec, groups: KVCacheGroups, max_model_len: int, chunk_tokens: int,
                **budget) -> dict:
    """The plan of one layout (hybrid or not). ``budget``: ``determine_num_blocks``'s keywords."""
    chunk = min(chunk_tokens, max_model_len)
    decode = groups.blocks_per_request(max_model_len, spec.block_size)
    with_chunk = groups.blocks_per_request(max_model_len, spec.block_size, chunk)
    num_blocks = determine_num_blocks(spec, max_model_len=max_model_len, groups=groups, chunk_tokens=chunk,
                                      **budget)
    reserve = with_chunk - decode
    return {
        "hybrid": groups.is_hybrid,
        "reason": groups.reason,
        "group_size": groups.group_size,
        "groups": group_rows(spec, groups, max_model_len),
        "bytes_per_block": spec.bytes_per_block_of(groups),
        "num_blocks": num_blocks,
        "kv_cache_bytes": num_blocks * spec.bytes_per_block_of(groups),
        "blocks_per_request": decode,
        "blocks_per_request_while_prefilling": with_chunk,
        "chunk_reserve_blocks": reserve,
        "max_concurrency": max(0, (num_blocks - reserve) // decode),
    }


def memory_plan(spec: KVCacheSpec, max_model_len: int, chunk_tokens: int, *,
                kv_cache_memory: Optional[int] = None, max_num_seqs: int = 256, **measured) -> dict:
    """Hybrid and non-hybrid plans side by side under one byte budget, with their
    concurrency ratio.

    The budget is ``kv_cache_memory``, else the GPU profile's (``measured``: the keywords
    of ``determine_num_blocks``), else the CPU default the engine gives the non-hybrid
    layout (the hybrid engine's own CPU default asks for less: room for ``max_num_seqs``
    requests). Raises ``ValueError`` (with the numbers) when one request of
    ``max_model_len`` tokens cannot fit, exactly as the engine would.
    """
    rule = kv_sizing_rule(None, kv_cache_memory, measured.get("device", "cpu"))
    single_groups = spec.kv_groups(hybrid=False)
    budget = dict(kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs, **measured)
    single = plan_layout(spec, single_groups, max_model_len, chunk_tokens, **budget)
    if kv_cache_memory is None:
        budget = dict(kv_cache_memory=single["kv_cache_bytes"], max_num_seqs=max_num_seqs)
    hybrid = plan_layout(spec, spec.kv_groups(hybrid=True), max_model_len, chunk_tokens, **budget)
    ratio = hybrid["max_concurrency"] / single["max_concurrency"] if single["max_concurrency"] else None
    return {
        "max_model_len": max_model_len,
        "block_size": spec.block_size,
        "dtype": spec.dtype,
        "kv_cache_dtype": spec.kv_cache_dtype,
        "kv_format": spec.kv_format.name,
        "bytes_per_token": spec.bytes_per_token,
        "step_token_budget": chunk_tokens,
        "sizing_rule": rule,
        "budget_bytes": budget["kv_cache_memory"] if budget["kv_cache_memory"] is not None else single["kv_cache_bytes"],
        "with_hybrid": hybrid,
        "without_hybrid": single,
        "concurrency_ratio": ratio,
    }


#: The formats ``format_rows`` compares: every distinct one (``auto`` and ``fp8`` are aliases).
PLAN_FORMATS = tuple(name for name in KV_CACHE_DTYPES if name not in ("auto", "fp8"))


def format_rows(spec: KVCacheSpec, max_model_len: int, chunk_tokens: int, budget_bytes: int,
                max_num_seqs: int = 256) -> list[dict]:
    """Every KV format side by side under one byte budget, in the engine's default layout
    (hybrid groups where the model has them): bytes per token, blocks, tokens and maximum
    concurrency, and the tokens relative to the model's dtype. A format the model cannot
    take (an odd head size for int4) or the budget cannot fit has ``error`` instead."""
    rows, base_tokens = [], None
    for name in PLAN_FORMATS:
        row: dict = {"kv_cache_dtype": name, "selected": name == spec.kv_format.name}
        try:
            fmt_spec = dataclasses.replace(spec, kv_cache_dtype=name)
            row["bytes_per_token"] = fmt_spec.bytes_per_token
            layout = plan_layout(fmt_spec, fmt_spec.kv_groups(hybrid=True), max_model_len, chunk_tokens,
                                 kv_cache_memory=budget_bytes, max_num_seqs=max_num_seqs)
        except ValueError as exc:
            row["error"] = str(exc)
            rows.append(row)
            continue
        row.update(num_blocks=layout["num_blocks"], tokens=layout["num_blocks"] * spec.block_size,
                   max_concurrency=layout["max_concurrency"])
        if name == spec.dtype:
            base_tokens = row["tokens"]
        rows.append(row)
    for row in rows:
        row["capacity_ratio"] = row["tokens"] / base_tokens if base_tokens and "tokens" in row else None
    return rows
