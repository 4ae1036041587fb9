"""CPU runtime pieces: the shared thread count and the oneDNN linears."""
from __future__ import annotations

import pytest

from kvpage.threads import available_cpus, resolve_num_threads

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
