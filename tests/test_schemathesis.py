"""The server fuzzed against its own OpenAPI schema with schemathesis.

A live server (``build_app`` + uvicorn on a 127.0.0.1 thread; see ``test_faults._LiveServer``)
gets schema-valid and schema-violating requests for every operation, a bounded number each.
No response may be a 5xx, a stream may never carry an in-band error, and afterwards the
server still answers, with every KV block free.
"""
from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable

schemathesis = pytest.importorskip("schemathesis")

from kvpage import LLM  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from server_process import CHAT_TEMPLATE  # noqa: E402
from test_faults import _LiveServer, assert_no_leak  # noqa: E402
from test_faults import one_torch_thread  # noqa: F401,E402 - an autouse fixture
from tiny_models import char_tokenizer, tiny_model  # noqa: E402

EXAMPLES_PER_OPERATION = 50  # for each of positive (schema-valid) and negative (schema-violating)
FUZZ = settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True, database=None,
                phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def served():
    tokenizer = char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    llm = LLM(tiny_model("llama"), tokenizer=tokenizer, block_size=4, num_kv_blocks=256, max_num_seqs=32,
              max_num_batched_tokens=128, max_model_len=64)
    with _LiveServer(llm) as base:
        yield llm, base
    llm.restore()


def test_no_5xx_for_anything_the_schema_allows_or_forbids(served):
    llm, base = served
    schema = schemathesis.openapi.from_url(base + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"} <= paths
    statuses: dict[int, int] = {}
    for operation in operations:
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            @FUZZ
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case):
                response = case.call(base_url=base, timeout=60)
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                case.validate_response(response, checks=[not_a_server_error])
                assert "generation_error" not in response.text, response.text[:500]

            try:
                run()
            except Unsatisfiable:
                # An operation without parameters or body (GET /health) has nothing to violate.
                assert mode is schemathesis.GenerationMode.NEGATIVE and operation.method.upper() == "GET"
    print(f"\nschemathesis: {sum(statuses.values())} requests over {len(operations)} operations, "
          f"statuses {dict(sorted(statuses.items()))}")
    assert statuses.get(200, 0) > 0 and statuses.get(400, 0) > 0  # both sides of the schema were reached
    # Still serving, nothing held.
    with httpx.Client(base_url=base, timeout=60) as http:
        assert http.get("/health").status_code == 200
        done = http.post("/v1/completions", json={"prompt": "still here?", "max_tokens": 3, "temperature": 0})
        assert done.status_code == 200 and done.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert_no_leak(llm.engine)
