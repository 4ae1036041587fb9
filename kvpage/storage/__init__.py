"""KV storage: per-layer KV specs, pool sizing, the paged K/V buffers and the lower tiers' bytes."""
