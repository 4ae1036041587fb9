"""KV blocks: the block pool, the radix prefix cache, per-request block tables, layer groups."""
