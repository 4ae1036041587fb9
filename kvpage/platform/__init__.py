"""The process's platform: compute threads, the thread governor, malloc tuning, model and cache paths."""
