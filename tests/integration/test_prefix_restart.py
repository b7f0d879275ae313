"""A warm prefix across a real restart of `warmstart serve`: chat with a long system prompt, SIGTERM (the drain saves
the cache), boot again: the first request after the restart reports cached_tokens > 0 and returns the same tokens
as a cold server. A corrupted file is ignored and changes no token."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.checkpoints import write_checkpoint
from tests.integration.server_process import ServerProcess

MODEL = "tiny-llama"
SYSTEM = ("You are a careful assistant for warmstart. Paris is the capital of France. The quick brown fox jumps "
          "over the lazy dog. warmstart restarts fast and counts every byte. ") * 4
ARGS = ("--kv-cache-memory", "16MiB", "--max-model-len", 1024, "--startup-plan", "off")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("restart") / MODEL, "llama", max_position=1024)


def serve(ckpt, tmp_path, name, *extra):
    srv = ServerProcess(ckpt, *ARGS, *extra, log_path=tmp_path / f"{name}.log")
    srv.wait_ready(timeout=120)
    return srv


def ask(srv, user: str, **kw):
    client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0, timeout=60)
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        max_tokens=12, temperature=0, **kw)


def cached(r) -> int:
    return r.usage.prompt_tokens_details.cached_tokens


def test_prefix_cache_survives_a_restart(ckpt, tmp_path):
    cache = ("--cache-dir", tmp_path / "cache")
    first = serve(ckpt, tmp_path, "first", *cache)
    try:
        a = ask(first, "Hello world")
        b = ask(first, "What is the capital of France?")
        assert cached(a) == 0 and cached(b) > 0 and b.usage.prompt_tokens > cached(b)
        assert first.metric("warmstart_cached_prompt_tokens_total") == cached(b)
        assert 0 < first.metric("warmstart_prefix_cache_hit_rate") < 1
    finally:
        assert first.terminate() == 0
    assert "prefix cache: saved" in first.log()
    (saved,) = (tmp_path / "cache" / "prefix").glob("*.safetensors")

    cold = serve(ckpt, tmp_path, "cold", "--no-prefix-caching", "--cache-dir", tmp_path / "cold-cache")
    try:
        expect = ask(cold, "Tell me about the fox.")
        assert cached(expect) == 0
    finally:
        cold.terminate()
    assert not (tmp_path / "cold-cache" / "prefix").exists()

    again = serve(ckpt, tmp_path, "again", *cache)
    try:
        restore = httpx.get(f"{again.base_url}/startup").json()["prefix_restore"]
        assert restore["status"] == "restored" and restore["blocks"] > 0 and restore["bytes"] > 0
        assert again.metric("warmstart_prefix_cache_restored_blocks") == restore["blocks"]
        r = ask(again, "Tell me about the fox.")             # the first request after the restart
        assert cached(r) > 0 and cached(r) % 16 == 0
        assert r.choices[0].message.content == expect.choices[0].message.content
        assert r.usage.completion_tokens == expect.usage.completion_tokens
        chunks = list(ask(again, "And the dog?", stream=True, stream_options={"include_usage": True}))
        assert cached(chunks[-1]) > 0
    finally:
        assert again.terminate() == 0

    data = bytearray(saved.read_bytes())
    data[len(data) // 2] ^= 0xFF                             # corrupt K/V bytes in the middle of the file
    saved.write_bytes(bytes(data))
    broken = serve(ckpt, tmp_path, "broken", *cache)
    try:
        restore = httpx.get(f"{broken.base_url}/startup").json()["prefix_restore"]
        assert restore["status"] == "ignored" and "SHA-256" in restore["reason"]
        assert "prefix restore: ignoring" in broken.log()
        r = ask(broken, "Tell me about the fox.")
        assert cached(r) == 0 and r.choices[0].message.content == expect.choices[0].message.content
    finally:
        broken.terminate()
