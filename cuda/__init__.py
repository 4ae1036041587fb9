"""Numba CUDA kernels over CuPy-allocated paged KV buffers (import name ``kvpage.cuda``).

Importing this package never touches a GPU: kernels compile lazily on first launch.
"""
