"""Compute kernels over raw paged buffers: the native C++ CPU library and the Numba CPU kernels."""
