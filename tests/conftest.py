import os
import sys

# Tests import helpers such as tiny_models from this folder.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# oneDNN (the CPU linears) keeps an LRU cache of one compiled matmul per input shape (1024
# entries by default), so resident memory rises until it is full. That is bounded, but it
# would hide a real leak from the soak test's flat-RSS check; a small cache makes the check
# see kvpage's own memory only. Read when torch loads, hence before any test imports it.
os.environ.setdefault("LRU_CACHE_CAPACITY", "16")
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16")
# A change of thread count can change fp32 matmul rounding (MKL splits some shapes
# differently), and the exactness tests compare kvpage with HF generate in one process: keep
# the thread governor off unless a test turns it on (test_thread_governor.py does).
os.environ.setdefault("KVPAGE_THREAD_GOVERNOR", "0")
# Inductor's C++ wrapper (kvpage's default for compiled CPU graphs, graph_passes) costs about
# a minute of C++ compilation per model on a cold cache, and CI's cache is always cold: the
# compiled tests run the Python wrapper, and test_compiled.py runs one family with the C++
# wrapper on. The kernels and so the outputs are the same under either wrapper.
os.environ.setdefault("KVPAGE_CPP_WRAPPER", "0")
# The engine's default mode compiles the forward on CPU (seconds to minutes per model): the
# suite's settings left unset take the exact mode's values instead (eager, torch's
# linears; kvpage.core.config), and a test that wants compilation or oneDNN asks for it.
os.environ.setdefault("KVPAGE_EXACT", "1")
