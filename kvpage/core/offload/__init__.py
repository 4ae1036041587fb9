"""The lower KV tiers' bookkeeping: which blocks move between the pool, host memory and disk."""
