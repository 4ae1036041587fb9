"""Models kvpage cannot serve exactly are refused with a ValueError naming why, and left as they were.

Tiny configs come from the census's generic shrinker, so each family keeps the layers that
make it special (a hybrid keeps its state-space layers, a sparse model its indexer).
"""
from __future__ import annotations

import pytest
import torch

tf = pytest.importorskip("transformers")

from kvpage import LLM  # noqa: E402
from kvpage.adapters.hf_runner import UnsupportedModelError  # noqa: E402
from kvpage.tools.census.tiny_config import tiny_config  # noqa: E402

CASES = {
    # keys chosen among compressed ones by an indexer with a cache of its own (plain DSA
    # indexers are served: test_sparse_indexer)
    "deepseek_v4": (tf.DeepseekV4Config, tf.DeepseekV4ForCausalLM, "'heavily_compressed_attention'"),
    # a learned relative-position bias handed to attention (Doge's key bias is ported: attention_ports)
    "inkling_text": (tf.InklingTextConfig, tf.InklingForCausalLM, "mask or bias of its own making"),
    # attention outside the interface, with no port (attention_ports)
    "xlnet": (tf.XLNetConfig, tf.XLNetLMHeadModel, "AttentionInterface"),
}


@pytest.mark.parametrize("family", list(CASES))
def test_refused_with_the_reason(family):
    config_class, model_class, reason = CASES[family]
    torch.manual_seed(0)
    model = model_class._from_config(tiny_config(config_class), dtype=torch.float32).eval()
    before = model.config._attn_implementation
    with pytest.raises(UnsupportedModelError, match=reason) as caught:
        LLM(model, block_size=4, num_kv_blocks=16, max_model_len=32)
    assert isinstance(caught.value, ValueError)
    assert model.config._attn_implementation == before  # left as it was


def test_recurrent_state_no_carrier_reaches_is_refused_naming_the_layer_type(monkeypatch):
    """State kept where neither transformers' Cache nor a family carrier reaches (here
    RecurrentGemma's block attributes, with its carrier taken away) is refused, the
    layer type named by the module that implements it."""
    from kvpage.adapters import families

    monkeypatch.setitem(families.FAMILIES, "recurrent_gemma", families.Family())
    torch.manual_seed(0)
    model = tf.RecurrentGemmaForCausalLM._from_config(tiny_config(tf.RecurrentGemmaConfig), dtype=torch.float32)
    with pytest.raises(UnsupportedModelError, match="layer type 'rg_lru' keeps recurrent state .* outside "
                                                    "transformers' Cache"):
        LLM(model.eval(), block_size=4, num_kv_blocks=16, max_model_len=32)
