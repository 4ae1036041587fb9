"""The two engine modes the census and ``kvpage check`` run kvpage in (torch-free, for reports)."""

#: Engine options per mode (``max_model_len`` is added by ``compare_with_hf``).
MODES: dict[str, dict] = {
    "stress": dict(block_size=4, num_kv_blocks=12, max_num_batched_tokens=6, enable_chunked_prefill=True,
                   enable_prefix_caching=True),
    "plain": dict(block_size=16, num_kv_blocks=64, enable_chunked_prefill=False, enable_prefix_caching=False),
}
#: What each mode exercises, for reports.
MODE_DESCRIPTIONS = {
    "stress": "block size 4, chunked prefill of 6 tokens per step, prefix-cache hits, preemption on a pool of "
              "one longest request",
    "plain": "block size 16, whole prompts in one step, no prefix cache",
}
