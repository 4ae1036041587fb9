"""``kvpage serve --replicas 2``: the command line starts Ray Serve, serves, and stops on SIGINT."""
from __future__ import annotations

import httpx
import pytest

pytest.importorskip("ray.serve")

from server_process import running_server, save_tiny_model  # noqa: E402

pytestmark = pytest.mark.ray


def test_serve_with_replicas_answers_and_shuts_down(tmp_path):
    model = save_tiny_model(str(tmp_path / "tiny"))
    args = ("--dtype", "float32", "--block-size", "4", "--num-kv-blocks", "256", "--max-model-len", "128",
            "--num-threads", "1", "--served-model-name", "tiny", "--replicas", "2", "--replica-num-cpus", "0.5")
    with running_server(model, *args, startup_timeout_s=240) as base:
        out = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 3},
                         timeout=60)
        assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 3
        assert "kvpage:router_prefix_hit_rate_estimate" in httpx.get(base + "/metrics", timeout=10).text
