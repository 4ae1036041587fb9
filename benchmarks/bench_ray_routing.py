"""Prefix-aware routing vs Ray Serve's default router, on kvpage replicas behind Ray Serve.

Workload: ``--tenants`` tenants, each with its own long system prompt, ``--requests-per-tenant``
chat requests each (the system prompt plus a short question of its own), arriving
interleaved (tenant 0, 1, ..., then again) through ``--concurrency`` concurrent clients.
Each replica's KV pool (``--num-kv-blocks``) holds about half of the tenants' prefixes plus
the running requests: the realistic regime, where where a request lands decides whether
its prefix is still cached.

For each router the app is deployed afresh (new replicas, empty caches) on one local Ray
instance and the workload runs once. Reported: the cluster-wide prefix-cache hit rate
(cached prompt tokens over prompt tokens, from every response's ``usage``), request and
output-token throughput, and for the prefix router its own hit-rate estimate.

    .venv/bin/python benchmarks/bench_ray_routing.py            # both routers, the defaults below

The model is a randomly initialised Llama built here (no weights are downloaded) with a
character tokenizer, so token counts equal character counts.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def save_model(folder: str, hidden: int, layers: int, max_len: int) -> str:
    """A random Llama (``hidden`` wide, ``layers`` deep) and a character tokenizer, as an HF folder."""
    import torch
    import transformers as tf

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny_models import VOCAB, char_tokenizer

    config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                            num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                            num_key_value_heads=max(1, hidden // 128), max_position_embeddings=max_len,
                            pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer = char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


def workload(tenants: int, per_tenant: int, prompt_chars: int, order: str = "shuffled",
             seed: int = 0) -> list[list[dict]]:
    """Chat messages of every request, interleaved by tenant: in rounds of one request per tenant,
    each round in a seeded random order ("shuffled") or always 0, 1, 2, ... ("round-robin")."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz     "
    systems = [f"You are the assistant of tenant {t}. " + "".join(rng.choice(letters) for _ in range(prompt_chars))
               for t in range(tenants)]
    requests = []
    for r in range(per_tenant):
        round_order = list(range(tenants))
        if order == "shuffled":
            rng.shuffle(round_order)
        requests += [[{"role": "system", "content": systems[t]}, {"role": "user", "content": f"Question {r} of {t}: why?"}]
                     for t in round_order]
    return requests


async def run_workload(base: str, requests: list[list[dict]], concurrency: int, max_tokens: int) -> dict:
    queue: asyncio.Queue = asyncio.Queue()
    for messages in requests:
        queue.put_nowait(messages)
    usages: list[dict] = []

    async def worker(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            messages = queue.get_nowait()
            response = await http.post("/v1/chat/completions", json={
                "model": "bench", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True})
            response.raise_for_status()
            usages.append(response.json()["usage"])

    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=base, timeout=300) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    prompt = sum(u["prompt_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    output = sum(u["completion_tokens"] for u in usages)
    return {"requests": len(usages), "seconds": round(elapsed, 2), "hit_rate": round(cached / prompt, 4),
            "requests_per_s": round(len(usages) / elapsed, 2), "output_tokens_per_s": round(output / elapsed, 1),
            "prompt_tokens": prompt, "cached_tokens": cached}


def router_estimate(base: str) -> float:
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith("kvpage:router_prefix_hit_rate_estimate "):
            return round(float(line.split()[-1]), 4)
    return float("nan")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--requests-per-tenant", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--order", choices=("shuffled", "round-robin"), default="shuffled",
                   help="tenant order within each round of requests")
    p.add_argument("--system-prompt-chars", type=int, default=360, help="tokens of each system prompt (about)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=112, help="KV pool of each replica, in blocks")
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--num-cpus", type=int, default=2, help="CPUs of the local Ray instance")
    p.add_argument("--routers", default="default,prefix", help="comma-separated, in the order they run")
    p.add_argument("--json", default=None, help="also write the results here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from kvpage.entrypoints.ray_serve.app import build_app
    from kvpage.entrypoints.ray_serve.local import deploy, local_serve

    args = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from server_process import free_port

    requests = workload(args.tenants, args.requests_per_tenant, args.system_prompt_chars, args.order)
    engine = dict(block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, max_model_len=1024,
                  dtype="float32", num_threads=max(1, args.num_cpus // args.replicas), max_num_seqs=32,
                  max_num_batched_tokens=1024)
    results = {}
    with tempfile.TemporaryDirectory() as folder, local_serve(args.num_cpus, free_port()) as base:
        save_model(folder, args.hidden, args.layers, 1024)
        for router in args.routers.split(","):
            deploy(build_app(folder, engine, {"served_model_names": ["bench"]}, num_replicas=args.replicas,
                             router=router, replica_num_cpus=args.num_cpus / args.replicas), timeout_s=600)
            result = asyncio.run(run_workload(base, requests, args.concurrency, args.max_tokens))
            if router == "prefix":
                result["router_estimate"] = router_estimate(base)
            results[router] = result
            print(f"{router:>8}: {json.dumps(result)}", flush=True)
    if "default" in results and "prefix" in results:
        d, p = results["default"], results["prefix"]
        print(f"hit rate x{p['hit_rate'] / max(d['hit_rate'], 1e-9):.2f}, "
              f"throughput x{p['requests_per_s'] / d['requests_per_s']:.2f} (prefix / default)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
