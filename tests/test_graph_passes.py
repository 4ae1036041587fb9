"""The compiled forward's graph passes (``kvpage.adapters.graph_passes``): sibling oneDNN
linears fused into one matmul, rotary tables realized once; each checked on the graph it
rewrites and on the numbers it computes, then end to end against HF ``generate``."""
from __future__ import annotations

import pytest
import torch

from kvpage.adapters import graph_passes
from kvpage.adapters.onednn_linear import _FUSED, onednn_available, use_onednn_linears

pytestmark = pytest.mark.skipif(not onednn_available(torch.nn.Linear(4, 4)), reason="oneDNN unavailable")


class Siblings(torch.nn.Module):
    """q/k/v on one input (fusable), an MLP's gate/up on another, and a lone output linear."""

    def __init__(self, bias_on_k_only: bool = False) -> None:
        super().__init__()
        self.q = torch.nn.Linear(32, 48, bias=False)
        self.k = torch.nn.Linear(32, 16, bias=bias_on_k_only)
        self.v = torch.nn.Linear(32, 16, bias=False)
        self.gate = torch.nn.Linear(32, 64, bias=True)
        self.up = torch.nn.Linear(32, 64, bias=True)
        self.out = torch.nn.Linear(64, 32, bias=False)

    def forward(self, x):
        h = self.q(x)[:, :16] + self.k(x) * self.v(x)
        y = x + h.repeat(1, 2)
        return self.out(torch.nn.functional.silu(self.gate(y)) * self.up(y))


def _compile_with(passes):
    seen = {}

    def backend(gm, example_inputs):
        seen["counts"] = [p(gm) for p in passes]
        seen["targets"] = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        return gm.forward

    return backend, seen


def _run(module, passes, x):
    torch._dynamo.reset()
    backend, seen = _compile_with(passes)
    with torch.inference_mode():
        out = torch.compile(module, backend=backend, dynamic=True)(x)
    return out, seen


def test_sibling_linears_fuse_into_one_matmul_per_input():
    torch.manual_seed(0)
    model = Siblings()
    x = torch.randn(5, 32)
    with torch.inference_mode():
        want = model(x)
    before = set(_FUSED)
    undo = use_onednn_linears(model)
    try:
        out, seen = _run(model, [graph_passes.fuse_sibling_linears], x)
        assert seen["counts"] == [2]  # (q, k, v) and (gate, up) with their biases
        fused = torch.ops.kvpage.onednn_linear_fused.default
        assert seen["targets"].count(fused) == 2
        assert seen["targets"].count(torch.ops.kvpage.onednn_linear.default) == 1  # `out` alone
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        assert len(set(_FUSED) - before) == 2
    finally:
        undo()
    assert set(_FUSED) <= before, "restoring the linears drops the fused weights"


def test_widened_siblings_share_their_cast_and_fuse():
    """A bf16 model's linears computing in float32 each cast their input: the casts of one
    input merge, and the siblings still fuse (the casts stay outside the op for inductor)."""
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("no oneDNN bf16 matmul on this CPU")
    torch.manual_seed(0)
    model = Siblings().to(torch.bfloat16)
    x = torch.randn(5, 32).to(torch.bfloat16)
    undo = use_onednn_linears(model, torch.float32)
    try:
        with torch.inference_mode():
            want = model(x)  # eager, widened
        out, seen = _run(model, [graph_passes.fuse_sibling_linears], x)
        assert seen["counts"] == [2]
        assert seen["targets"].count(torch.ops.kvpage.onednn_linear_fused.default) == 2
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, want, rtol=2 ** -7, atol=1e-2)
    finally:
        undo()


def test_members_with_and_without_bias_stay_separate():
    torch.manual_seed(1)
    model = Siblings(bias_on_k_only=True)
    x = torch.randn(3, 32)
    with torch.inference_mode():
        want = model(x)
    undo = use_onednn_linears(model)
    try:
        out, seen = _run(model, [graph_passes.fuse_sibling_linears], x)
        assert seen["counts"] == [1]  # only gate/up
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    finally:
        undo()


def test_plain_linears_are_left_alone():
    model = Siblings()
    _, seen = _run(model, [graph_passes.fuse_sibling_linears], torch.randn(2, 32))
    assert seen["counts"] == [0]


def rotary_like(positions, inv_freq, x):
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), torch.sin(emb)
    return x * cos + x.flip(-1) * sin, x * cos * 2


def test_rotary_tables_are_realized_once():
    positions = torch.arange(7)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    x = torch.randn(7, 8)
    want = rotary_like(positions, inv_freq, x)
    torch._dynamo.reset()
    backend, seen = _compile_with([graph_passes.realize_rotary_tables])
    out = torch.compile(rotary_like, backend=backend, dynamic=True)(positions, inv_freq, x)
    assert seen["counts"] == [2]
    assert seen["targets"].count(torch.ops.kvpage.realized.default) == 2
    for got, ref in zip(out, want):
        torch.testing.assert_close(got, ref)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v with biases
def test_compiled_onednn_greedy_matches_hf(family):
    from kvpage import LLM, SamplingParams
    from tiny_models import VOCAB, hf_greedy, tiny_model

    model = tiny_model(family)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (1, 6, 19)]
    expected = [hf_greedy(model, p, 8) for p in prompts]
    before = set(_FUSED)
    llm = LLM(model, block_size=4, num_kv_blocks=48, max_model_len=48, enforce_eager=False, onednn_linears=True)
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert set(_FUSED) - before, "the compiled forward ran the fused linears"
    finally:
        llm.restore()
    assert set(_FUSED) <= before


def test_inserted_nodes_carry_example_values():
    """Nodes the passes add have the fake values dynamo gives its own (AOTAutograd's cache
    refuses a graph with method calls on a tensor node without one)."""
    torch.manual_seed(0)
    model = Siblings()
    undo = use_onednn_linears(model)
    try:
        torch._dynamo.reset()
        inserted = []

        def backend(gm, example_inputs):
            before = set(gm.graph.nodes)
            graph_passes.fuse_sibling_linears(gm)
            inserted.extend(n for n in gm.graph.nodes if n not in before)
            return gm.forward

        with torch.inference_mode():
            torch.compile(model, backend=backend, dynamic=True)(torch.randn(5, 32))
    finally:
        undo()
    assert len(inserted) == 2 + 5  # two fused calls, five column ranges
    for node in inserted:
        value = node.meta["example_value"]
        assert isinstance(value, torch._subclasses.fake_tensor.FakeTensor) and value.dtype == torch.float32
    widths = [int(n.meta["example_value"].shape[-1]) for n in inserted if n.target is torch.narrow]
    assert sorted(widths) == [16, 16, 48, 64, 64]


class SiblingsWithMethods(Siblings):
    """Tensor methods on the fused members' outputs, as HF attention does (``.view``)."""

    def forward(self, x):
        h = self.q(x).view(x.shape[0], 3, 16).sum(1) + self.k(x).view(-1, 16) * self.v(x)
        y = x + h.repeat(1, 2)
        return self.out(torch.nn.functional.silu(self.gate(y)).view(-1, 64) * self.up(y))


def test_rewritten_graph_is_served_from_the_disk_cache(tmp_path, monkeypatch):
    """A second compilation of the same model (a restart) loads AOTAutograd's cached
    artifact instead of tracing the model again."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = SiblingsWithMethods()
    undo = use_onednn_linears(model)
    try:
        for _ in range(2):
            torch._dynamo.reset()
            counters.clear()
            with torch.inference_mode():
                torch.compile(model, backend=graph_passes.kvpage_inductor, dynamic=True)(torch.randn(5, 32))
            assert counters["aot_autograd"]["autograd_cache_bypass"] == 0
    finally:
        undo()
        torch._dynamo.reset()
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1


def test_cpu_graphs_get_the_cpp_wrapper_unless_turned_off(monkeypatch):
    cpu_inputs = [torch.zeros(3), 5]
    monkeypatch.delenv("TORCHINDUCTOR_CPP_WRAPPER", raising=False)
    monkeypatch.setenv("KVPAGE_CPP_WRAPPER", "1")
    assert graph_passes.cpp_wrapper_patches(cpu_inputs) == {"cpp_wrapper": True}
    assert graph_passes.cpp_wrapper_patches([torch.zeros(3, device="meta")]) == {}  # not a CPU graph
    monkeypatch.setenv("KVPAGE_CPP_WRAPPER", "0")
    assert graph_passes.cpp_wrapper_patches(cpu_inputs) == {}
    monkeypatch.setenv("KVPAGE_CPP_WRAPPER", "1")
    monkeypatch.setenv("TORCHINDUCTOR_CPP_WRAPPER", "0")  # the user's own choice wins
    assert graph_passes.cpp_wrapper_patches(cpu_inputs) == {}


def _compile_at_thread_counts(model, counts) -> list[int]:
    """Compile ``model`` once per thread count in ``counts`` (as a governed engine's two
    entries); the cache hits (AOTAutograd's or inductor's) of each compilation."""
    from torch._dynamo.utils import counters

    hits, before = [], torch.get_num_threads()
    try:
        compiled = torch.compile(model, backend=graph_passes.kvpage_inductor, dynamic=True)
        for count in counts:
            torch.set_num_threads(count)
            counters.clear()
            with torch.inference_mode():
                compiled(torch.randn(5, 32))
            hits.append(counters["aot_autograd"]["autograd_cache_hit"] + counters["inductor"]["fxgraph_cache_hit"])
    finally:
        torch.set_num_threads(before)
    return hits


@pytest.mark.parametrize("user_setting", [None, "0"])
def test_a_second_thread_count_loads_the_first_ones_code(tmp_path, monkeypatch, user_setting):
    """CPU kernels read their thread count at run time, so the entry compiled for another
    count is the same code and comes from the cache; the user's own setting wins."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    if user_setting is None:
        monkeypatch.delenv("TORCHINDUCTOR_CPP_DYNAMIC_THREADS", raising=False)
    else:
        monkeypatch.setenv("TORCHINDUCTOR_CPP_DYNAMIC_THREADS", user_setting)
    assert graph_passes.cpu_thread_patches([torch.zeros(3)]) == ({} if user_setting else {"cpp.dynamic_threads": True})
    assert graph_passes.cpu_thread_patches([torch.zeros(3, device="meta")]) == {}
    torch.manual_seed(0)
    model = SiblingsWithMethods()
    undo = use_onednn_linears(model)
    torch._dynamo.reset()
    try:
        hits = _compile_at_thread_counts(model, (2, 1))
    finally:
        undo()
        torch._dynamo.reset()
    assert hits[0] == 0
    assert (hits[1] > 0) == (user_setting is None)
