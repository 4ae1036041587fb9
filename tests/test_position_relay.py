"""Bart-style decoders number positions from their own cache length; kvpage relays the
step's ``position_ids`` to their positional embeddings (``adapters/position_relay.py``).

Exactness against HF for these families runs in ``test_hf_exactness`` (extended families)
and, compiled, in ``test_compiled``; this file checks the hooks' life cycle and the refusal
that remains for models the relay cannot fix.
"""
from __future__ import annotations

import pytest
import torch

from kvpage import LLM, SamplingParams
from kvpage.adapters import hf_runner
from kvpage.adapters.position_relay import positional_embeddings, relay_position_ids
from tiny_models import VOCAB, hf_greedy, tiny_model


def _hooks(model) -> int:
    modules = [model] + positional_embeddings(model)
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in modules)


def test_models_that_follow_position_ids_get_no_hooks():
    model = tiny_model("llama")
    assert positional_embeddings(model) == [] and relay_position_ids(model) is None
    llm = LLM(model, block_size=4, num_kv_blocks=16, max_model_len=64)
    try:
        assert _hooks(model) == 0
    finally:
        llm.restore()


@pytest.mark.parametrize("family", ["bart", "pegasus"])
def test_relay_is_installed_and_removed_by_restore(family):
    model = tiny_model(family)
    prompt = torch.randint(3, VOCAB, (11,), generator=torch.Generator().manual_seed(3)).tolist()
    expected = hf_greedy(model, prompt, 6)
    llm = LLM(model, block_size=4, num_kv_blocks=32, max_model_len=64)
    try:
        assert _hooks(model) == 3  # keep + forget on the model, swap-in on the one decoder embedding
        out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
        assert out[0].outputs[0].token_ids == expected
    finally:
        llm.restore()
    assert _hooks(model) == 0
    assert hf_greedy(model, prompt, 6) == expected  # the model is HF's own again


def test_positions_are_relayed_per_token():
    """Two sequences in one flattened step at different positions embed as they would alone."""
    model = tiny_model("bart")
    remove = relay_position_ids(model)
    try:
        ids = torch.tensor([[5, 6, 7]])
        embed = positional_embeddings(model)[0]
        seen = []
        handle = embed.register_forward_hook(lambda _m, _a, out: seen.append(out.detach().clone()))
        with torch.inference_mode():
            model(input_ids=ids, position_ids=torch.tensor([[9, 0, 1]]), use_cache=False)
        handle.remove()
        table = embed.weight
        assert torch.equal(seen[0].reshape(3, -1), table[torch.tensor([9, 0, 1]) + embed.offset])
    finally:
        remove()


def test_models_the_relay_cannot_fix_are_still_refused(monkeypatch):
    monkeypatch.setattr(hf_runner, "relay_position_ids", lambda model: None)
    model = tiny_model("bart")
    with pytest.raises(hf_runner.UnsupportedModelError, match="ignores position_ids"):
        LLM(model, block_size=4, num_kv_blocks=16, max_model_len=64)
    assert _hooks(model) == 0
