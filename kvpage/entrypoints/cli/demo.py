"""``kvpage demo``: chat questions sharing a system prompt, served by paged continuous
batching on the embedded SmolLM2, then the same prompts through plain HF ``generate``."""
from __future__ import annotations

import time

SYSTEM_PROMPT = (
    "You are a concise assistant for a science museum. Answer in one or two short sentences, "
    "in plain words a curious visitor understands. If you are not sure, say so."
)
QUESTIONS = [
    "What is the capital of France?",
    "Why is the sky blue?",
    "How many legs does a spider have?",
    "What is photosynthesis?",
    "Why do we have seasons?",
    "What is the boiling point of water at sea level?",
    "How far away is the Moon?",
    "What are black holes?",
    "Why do cats purr?",
    "What is DNA?",
    "How do airplanes stay in the air?",
    "What causes rainbows?",
    "What is the largest planet in our solar system?",
    "Why is the ocean salty?",
    "How do vaccines work?",
    "What is gravity?",
]


def _chat_prompt(tokenizer, question: str) -> str:
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _hf_generate(llm, prompts: list[str], max_tokens: int) -> tuple[list[str], float, int]:
    """Plain HF generate, one prompt at a time (unpadded), greedy; returns texts, seconds, tokens."""
    import torch

    texts, produced = [], 0
    start = time.perf_counter()
    for prompt in prompts:
        ids = llm.tokenizer(prompt, return_tensors="pt").input_ids.to(llm.model.device)
        with torch.inference_mode():
            out = llm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                     do_sample=False)
        new = out[0, ids.shape[1]:]
        produced += int(new.shape[0])
        texts.append(llm.tokenizer.decode(new, skip_special_tokens=True))
    return texts, time.perf_counter() - start, produced


def run_demo(model: str = "smollm2-135m", num_prompts: int = 12, max_tokens: int = 48, compare_hf: bool = True,
             dtype: str = "float32", exact: bool = True) -> int:
    """Float32 and the exact mode by default: the demo checks greedy answers against HF
    ``generate`` one prompt at a time, and only float32 is batch-invariant enough for that
    (bf16 rounding differs between a batch of 12 and a batch of 1, so a few answers diverge
    after some tokens). ``exact=False`` runs the engine's default (fast) mode instead."""
    from kvpage import LLM, SamplingParams

    mode = "exact" if exact else "fast"
    print(f"Loading {model} ({dtype}, {mode} mode) ...", flush=True)
    llm = LLM(model, max_num_seqs=32, block_size=16, dtype=dtype, exact=exact)
    questions = (QUESTIONS * (num_prompts // len(QUESTIONS) + 1))[:num_prompts]
    prompts = [_chat_prompt(llm.tokenizer, q) for q in questions]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)

    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    stats = llm.stats()

    for question, out in list(zip(questions, outputs))[:4]:
        print(f"\nQ: {question}\nA: {out.outputs[0].text.strip()}")
    hit_rate = stats["prefix_cache_hits"] / max(stats["prefix_cache_queries"], 1)
    print(f"\n=== kvpage (paged KV, continuous batching, prefix caching; {mode} mode) ===")
    print(f"requests: {len(prompts)}   generated tokens: {generated}   time: {elapsed:.2f} s   "
          f"throughput: {generated / elapsed:.1f} tok/s")
    print(f"KV blocks: {stats['num_blocks']}   peak usage: {stats['peak_kv_cache_usage']:.1%}   "
          f"mean fragmentation: {stats['mean_kv_fragmentation']:.1%}   peak concurrent: {stats['peak_num_running']}")
    print(f"prefix-cache hit rate: {hit_rate:.1%} ({stats['prefix_cache_hits']} of "
          f"{stats['prefix_cache_queries']} prompt tokens)   preemptions: {stats['num_preemptions']}")
    assert stats["num_free_blocks"] == stats["num_blocks"], "blocks leaked"

    if compare_hf:
        llm.restore()  # HF's own attention and linears (the fast mode swapped the linears)
        texts, hf_elapsed, hf_tokens = _hf_generate(llm, prompts, max_tokens)
        same = sum(t.strip() == o.outputs[0].text.strip() for t, o in zip(texts, outputs))
        print("\n=== plain HF generate (one prompt at a time) ===")
        print(f"generated tokens: {hf_tokens}   time: {hf_elapsed:.2f} s   throughput: {hf_tokens / hf_elapsed:.1f} tok/s")
        print(f"identical greedy answers: {same} of {len(prompts)}   speed-up: {hf_elapsed / elapsed:.2f}x")
    return 0
