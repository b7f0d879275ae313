"""API key, CORS and the vLLM-shaped metrics, against a real server started with WARMSTART_API_KEY and
--allowed-origins."""
from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.checkpoints import write_checkpoint
from tests.integration.server_process import ServerProcess

MODEL = "tiny-llama"
KEY = "s3cret-key"
GOOD, EVIL = "http://app.example", "http://evil.example"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("access")
    ckpt = write_checkpoint(tmp / MODEL, "llama", max_position=512)
    srv = ServerProcess(ckpt, "--kv-cache-memory", "16MiB", "--max-model-len", 512, "--cache-dir", tmp / "cache",
                        "--allowed-origins", GOOD, log_path=tmp / "server.log", env={"WARMSTART_API_KEY": KEY})
    try:
        srv.wait_ready(timeout=120)
        yield srv
    finally:
        srv.terminate()


def test_key_is_required_on_api_routes_and_open_routes_stay_open(server):
    base = server.base_url
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(base + path).status_code == 200, path
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"},
                    {"Authorization": f"Bearer {KEY}x"}):
        r = httpx.get(f"{base}/v1/models", headers=headers)
        assert r.status_code == 401, headers
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.post(f"{base}/v1/chat/completions", json={}).status_code == 401
    assert httpx.post(f"{base}/tokenize", json={"prompt": "a"}).status_code == 401
    assert httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base}/v1", api_key="nope", max_retries=0).models.list()
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert r.choices[0].message.content is not None


def test_cors_preflight_only_for_listed_origins(server):
    def preflight(origin: str) -> httpx.Response:
        return httpx.options(f"{server.base_url}/v1/chat/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
    ok = preflight(GOOD)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == GOOD
    bad = preflight(EVIL)
    assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers
    r = httpx.get(f"{server.base_url}/v1/models", headers={"Origin": GOOD, "Authorization": f"Bearer {KEY}"})
    assert r.headers["access-control-allow-origin"] == GOOD
    r = httpx.get(f"{server.base_url}/v1/models", headers={"Origin": EVIL, "Authorization": f"Bearer {KEY}"})
    assert "access-control-allow-origin" not in r.headers


def test_metrics_parse_with_vllm_names_and_model_label(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0)
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0,
                              extra_body={"ignore_eos": True})
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{server.base_url}/metrics").text)}
    samples = {s.name: s for f in families.values() for s in f.samples}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:prompt_tokens", "vllm:generation_tokens",
                 "vllm:request_success", "vllm:num_preemptions"):
        assert name in families, name
        assert all(s.labels.get("model_name") == MODEL for s in families[name].samples), name
    assert families["vllm:prompt_tokens"].type == "counter" and families["vllm:kv_cache_usage_perc"].type == "gauge"
    assert samples["vllm:generation_tokens_total"].value >= 4
    assert samples["vllm:inter_token_latency_seconds_count"].value >= 3           # 4 tokens, 3 gaps
    assert samples["vllm:e2e_request_latency_seconds_count"].value >= 1
    success = {s.labels["finished_reason"]: s.value for s in families["vllm:request_success"].samples
               if s.name == "vllm:request_success_total"}
    assert success["length"] >= 1
    assert 0 <= samples["vllm:kv_cache_usage_perc"].value <= 1
    assert not [s for s in samples if s.endswith("_created")]
    assert families["warmstart_kv_blocks_allocated"].type == "gauge"
    assert samples["warmstart_kv_blocks_allocated"].value > 0 and "warmstart_kv_blocks_total" not in samples
