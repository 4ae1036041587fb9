"""CPU runtime pieces: the shared thread count and the oneDNN linears."""
from __future__ import annotations

import pytest

from kvpage.platform.threads import available_cpus, loaded_openmp_runtimes, release_thread_pools, resolve_num_threads

torch = pytest.importorskip("torch")


def test_cgroup_quota_caps_the_thread_count(tmp_path):
    quota = tmp_path / "cpu.max"
    quota.write_text("150000 100000\n")  # 1.5 CPUs -> 1
    assert available_cpus(str(quota)) == 1
    quota.write_text("max 100000\n")
    assert available_cpus(str(quota)) >= 1
    assert available_cpus(str(tmp_path / "missing")) >= 1


def test_thread_count_precedence(monkeypatch):
    monkeypatch.setenv("KVPAGE_NUM_THREADS", "3")
    assert resolve_num_threads(5) == 5
    assert resolve_num_threads(None) == 3
    monkeypatch.setenv("KVPAGE_NUM_THREADS", "zero")
    with pytest.raises(ValueError, match="KVPAGE_NUM_THREADS"):
        resolve_num_threads(None)


def test_a_fresh_process_runs_torch_at_the_configured_count():
    """Numba's first ``set_num_threads`` launches its pool and sets the OpenMP count torch
    reads to numba's full count; configured after it, torch keeps the engine's count."""
    import os
    import subprocess
    import sys

    script = ("import torch, numba\n"
              "from kvpage.platform.threads import configure_threads\n"
              "configure_threads(1)\n"
              "print(torch.get_num_threads(), numba.get_num_threads())\n")
    env = {**os.environ, "NUMBA_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "1"]


def test_openmp_runtimes_are_found_in_the_memory_map(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 1 /venv/torch/lib/libgomp.so.1\n"
        "7f01-7f02 r--p 00001000 08:01 1 /venv/torch/lib/libgomp.so.1\n"
        "7f02-7f03 r-xp 00000000 08:01 2 /usr/lib/x86_64-linux-gnu/libgomp.so.1.0.0\n"
        "7f03-7f04 r-xp 00000000 08:01 3 /usr/lib/libgompish-other.so\n"  # a prefix match, still a runtime name
        "7f04-7f05 r-xp 00000000 08:01 4 /usr/lib/libc.so.6\n"
        "7f05-7f06 rw-p 00000000 00:00 0 \n"
        "7f06-7f07 rw-p 00000000 00:00 0 [heap]\n")
    found = loaded_openmp_runtimes(str(maps))
    assert found[:2] == ["/venv/torch/lib/libgomp.so.1", "/usr/lib/x86_64-linux-gnu/libgomp.so.1.0.0"]
    assert "/usr/lib/libc.so.6" not in found
    assert loaded_openmp_runtimes(str(tmp_path / "missing")) == []


def test_released_thread_pools_leave_torch_and_numba_working():
    """Releasing the calling thread's OpenMP pools (before a hand-off to an engine thread)
    keeps both libraries' parallel results right in this thread and in a new one."""
    import threading

    import numpy as np

    from kvpage.attention.numba_cpu import paged_attention_numba

    x = torch.arange(1 << 16, dtype=torch.float32)
    expected = float(x.sum())
    q = np.ones((2, 2, 4), np.float32)
    cache = np.ones((4, 4, 1, 4), np.float32)
    args = (q, cache, cache, np.arange(3, dtype=np.int32), np.array([3, 5], np.int32),
            np.array([[0, 1], [2, 3]], np.int32), 0.5)
    before = paged_attention_numba(*args)
    if torch.__config__.parallel_info().count("OpenMP") and loaded_openmp_runtimes():
        assert release_thread_pools() >= 1  # torch's own libgomp at least
    assert float(x.sum()) == expected
    np.testing.assert_array_equal(paged_attention_numba(*args), before)
    results = []
    worker = threading.Thread(target=lambda: results.append((float(x.sum()), paged_attention_numba(*args))))
    worker.start()
    worker.join()
    assert results[0][0] == expected
    np.testing.assert_array_equal(results[0][1], before)


def test_the_engine_thread_adopts_the_engine_thread_count():
    """numba keeps its thread count per thread: the engine thread of ``AsyncLLM`` takes the
    engine's count, whatever numba's default is in a fresh thread."""
    import threading

    import numba

    from kvpage import LLM
    from tiny_models import tiny_model

    from kvpage.platform.threads import set_compute_threads

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs numba to allow 2 threads")
    previous = torch.get_num_threads()
    llm = LLM(tiny_model("llama"), block_size=4, num_kv_blocks=32, max_model_len=64, num_threads=1)
    try:
        assert llm.engine.compute_threads == 1
        seen = []

        def engine_thread() -> None:
            seen.append(numba.get_num_threads())  # a fresh thread: numba's default
            llm.engine.adopt_current_thread()
            seen.append(numba.get_num_threads())

        worker = threading.Thread(target=engine_thread)
        worker.start()
        worker.join()
        assert seen == [numba.config.NUMBA_NUM_THREADS, 1]
    finally:
        llm.restore()
        set_compute_threads(previous)  # the rest of the suite runs at the count it started with


def test_onednn_linears_match_and_restore():
    from kvpage.adapters.onednn_linear import OneDnnLinear, onednn_available, use_onednn_linears

    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 8, bias=False))
    if not onednn_available(model):
        pytest.skip("oneDNN is not available in this torch build")
    x = torch.randn(5, 7, 32)
    with torch.inference_mode():
        want = model(x)
        undo = use_onednn_linears(model)
        assert isinstance(model[0], OneDnnLinear) and model[0].weight is not None
        assert set(model.state_dict()) == {"0.weight", "0.bias", "2.weight"}
        got = model(x)
        undo()
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert type(model[0]) is torch.nn.Linear and type(model[2]) is torch.nn.Linear


def test_onednn_linears_are_opt_in_and_restored():
    from kvpage import LLM
    from kvpage.adapters.onednn_linear import OneDnnLinear, onednn_available
    from tiny_models import tiny_model

    model = tiny_model("llama")
    if not onednn_available(model):
        pytest.skip("oneDNN is not available in this torch build")
    kinds = lambda: {type(m) for m in model.modules()}  # noqa: E731
    plain = LLM(model, block_size=4, num_kv_blocks=16, max_model_len=64)
    assert OneDnnLinear not in kinds()
    plain.restore()
    fast = LLM(model, block_size=4, num_kv_blocks=16, max_model_len=64, onednn_linears=True)
    assert OneDnnLinear in kinds()
    fast.restore()
    assert OneDnnLinear not in kinds()
