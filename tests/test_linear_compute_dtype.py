"""A half-precision model's oneDNN linears computing in float32 (``linear_compute_dtype``)."""
import pytest
import torch

from kvpage import LLM
from kvpage.adapters import onednn_linear
from kvpage.adapters.onednn_linear import OneDnnLinear, onednn_available, pick_compute_dtype, use_onednn_linears
from kvpage.core.config import EngineConfig
from tiny_models import tiny_model

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")


def _bf16_mlp(dtype: torch.dtype = torch.bfloat16) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.SiLU(), torch.nn.Linear(96, 32, bias=False)).to(dtype)


def _wide_reference(model: torch.nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """Each linear in float64 from the half-precision values, rounded back, as the widened path
    rounds each output (so only the float32 summation order separates the two)."""
    h = x
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            bias = None if layer.bias is None else layer.bias.double()
            h = torch.nn.functional.linear(h.double(), layer.weight.double(), bias).to(x.dtype)
        else:
            h = layer(h)
    return h


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_widened_linears_compute_in_float32_and_keep_the_weights(dtype):
    model = _bf16_mlp(dtype)
    x = torch.randn(5, 7, 64).to(dtype)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.inference_mode():
        undo = use_onednn_linears(model, torch.float32)
        assert isinstance(model[0], OneDnnLinear)
        assert onednn_linear._REORDERED[model[0].weight.data_ptr()].dtype == torch.float32
        assert onednn_linear._REORDERED[model[0].weight.data_ptr()].bias.dtype == torch.float32
        got = model(x)
        undo()
    assert got.dtype == dtype and got.shape == (5, 7, 32)
    # one rounding step apart at most (float32 vs float64 sums landing either side)
    torch.testing.assert_close(got, _wide_reference(model, x), rtol=2 ** -7, atol=1e-3)
    assert all(torch.equal(v, before[k]) and v.dtype == dtype for k, v in model.state_dict().items())
    assert type(model[0]) is torch.nn.Linear and not onednn_linear._REORDERED


def test_widened_fused_linear_is_the_members_side_by_side():
    """The compiled graph's fused sibling linears widen like their members."""
    torch.manual_seed(1)
    a, b = torch.nn.Linear(64, 24).to(torch.bfloat16), torch.nn.Linear(64, 40).to(torch.bfloat16)
    model = torch.nn.ModuleList([a, b])
    x = torch.randn(9, 64).to(torch.bfloat16)
    with torch.inference_mode():
        undo = use_onednn_linears(model, torch.float32)
        try:
            separate = torch.cat([model[0](x), model[1](x)], -1)
            fused = torch.ops.kvpage.onednn_linear_fused(x, [a.weight, b.weight], [a.bias, b.bias])
            packed, bias = onednn_linear.fused_weight([a.weight, b.weight], [a.bias, b.bias])
        finally:
            undo()
    assert packed.dtype == torch.float32 and bias.dtype == torch.float32 and fused.dtype == torch.bfloat16
    torch.testing.assert_close(fused, separate, rtol=2 ** -7, atol=1e-3)


def test_pick_compute_dtype_settings():
    model = _bf16_mlp()
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert pick_compute_dtype(model, "model")[0] == torch.float32  # no bf16 matmul: the only way
        return
    assert pick_compute_dtype(model, "model") == (torch.bfloat16, "the model's dtype")
    assert pick_compute_dtype(model, "float32") == (torch.float32, "asked for")
    assert pick_compute_dtype(model.float(), "auto")[0] == torch.float32
    with pytest.raises(ValueError, match="one of auto, model, float32"):
        pick_compute_dtype(model, "fp8")


@pytest.mark.parametrize("speedup,want", [(1.5, torch.float32), (1.1, torch.bfloat16)])
def test_auto_widens_on_a_measured_win(monkeypatch, speedup, want):
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("no oneDNN bf16 matmul on this CPU")
    timed = []

    def seconds(weight, dtype, rows, reps=5):
        timed.append((tuple(weight.shape), dtype, rows))
        return 1.0 if dtype == torch.float32 else speedup

    monkeypatch.setattr(onednn_linear, "_seconds_per_matmul", seconds)
    dtype, why = pick_compute_dtype(_bf16_mlp(), "auto")
    assert dtype == want and f"{speedup:.2f}x" in why
    # the widest weight, timed at each dtype for a decode batch and a prompt chunk
    assert sorted(timed, key=str) == sorted([((96, 64), d, r) for d in (torch.bfloat16, torch.float32)
                                             for r in onednn_linear._TIMED_ROWS], key=str)


def test_auto_keeps_the_model_dtype_when_memory_is_short(monkeypatch):
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("no oneDNN bf16 matmul on this CPU")
    monkeypatch.setattr(onednn_linear, "free_ram_bytes", lambda: 1000)
    monkeypatch.setattr(onednn_linear, "_seconds_per_matmul", lambda *a, **k: pytest.fail("timed anyway"))
    dtype, why = pick_compute_dtype(_bf16_mlp(), "auto")
    assert dtype == torch.bfloat16 and "available memory" in why


def test_config_checks_the_setting(monkeypatch):
    with pytest.raises(ValueError, match="linear_compute_dtype must be one of"):
        EngineConfig(linear_compute_dtype="half")
    with pytest.raises(ValueError, match="contradicts"):
        EngineConfig(exact=True, linear_compute_dtype="float32")
    with pytest.raises(ValueError, match="contradicts onednn_linears=False"):
        EngineConfig(onednn_linears=False, linear_compute_dtype="float32")
    monkeypatch.setenv("KVPAGE_EXACT", "1")
    assert not EngineConfig().uses_onednn
    assert EngineConfig(linear_compute_dtype="float32").uses_onednn  # asking to widen turns them on


class _WideLinear(torch.nn.Module):
    """HF's side of the comparison: a linear computed in float32 from its bf16 values and
    rounded back, by torch's own matmul."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.linear.bias is None else self.linear.bias.float()
        return torch.nn.functional.linear(x.float(), self.linear.weight.float(), bias).to(x.dtype)


def _widen_for_hf(model: torch.nn.Module) -> None:
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, _WideLinear(child))


def test_engine_with_float32_linears_matches_hf_widened_alike():
    """A bf16 model through the engine with widened oneDNN linears against HF's forward of
    the same model with each linear widened the same way: prompt log-probabilities, chunked
    prefill included. (bf16 activations round at each step, and a float32 sum in another
    order can land one bf16 step away, so equality is not expected: closeness is.)"""
    from kvpage import SamplingParams
    from kvpage.entrypoints.openai.startup import mode_summary

    model = tiny_model("llama").to(torch.bfloat16)
    if not onednn_available(model):
        pytest.skip("oneDNN is not available in this torch build")
    prompt = torch.randint(3, model.config.vocab_size, (29,), generator=torch.Generator().manual_seed(3)).tolist()
    llm = LLM(model, block_size=4, num_kv_blocks=32, max_model_len=64, max_num_batched_tokens=8,
              linear_compute_dtype="float32")
    try:
        assert llm.runner.linear_compute == (torch.float32, "asked for")
        assert "oneDNN linears computing in float32 (asked for)" in mode_summary(llm.runner)
        out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
        got = torch.tensor([e.logprob for e in out.prompt_logprobs[1:]])
    finally:
        llm.restore()
    assert not any(isinstance(m, OneDnnLinear) for m in model.modules())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    _widen_for_hf(model)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0].float()
    want = torch.log_softmax(logits, -1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    torch.testing.assert_close(got, want, rtol=0, atol=0.1)
    assert (got - want).abs().mean() < 0.02


def test_auto_times_a_layer_linear_not_the_output_embedding(monkeypatch):
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("no oneDNN bf16 matmul on this CPU")
    model = tiny_model("llama").to(torch.bfloat16)
    timed = set()
    monkeypatch.setattr(onednn_linear, "_seconds_per_matmul",
                        lambda weight, dtype, rows, reps=5: timed.add(weight.data_ptr()) or 1.0)
    pick_compute_dtype(model, "auto")
    head = model.get_output_embeddings().weight.data_ptr()
    layers = {m.weight.data_ptr() for m in model.model.modules() if isinstance(m, torch.nn.Linear)}
    assert len(timed) == 1 and timed <= layers and head not in timed
