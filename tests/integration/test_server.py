"""`warmstart serve` as clients use it: the official openai client against a real server process on 127.0.0.1.

One tiny random llama (written by the test) serves every test in this module. Its context is 2048 tokens so that a
long generation takes seconds, long enough to disconnect from mid-stream."""
from __future__ import annotations

import asyncio
import json
import math
import os
import time

import httpx
import openai
import pytest

from tests.checkpoints import write_checkpoint
from tests.integration.server_process import ServerProcess

MODEL = "tiny-llama"
MAX_LEN = 2048


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    ckpt = write_checkpoint(tmp / MODEL, "llama", max_position=MAX_LEN)
    srv = ServerProcess(ckpt, "--kv-cache-memory", "64MiB", "--max-model-len", MAX_LEN, "--cache-dir",
                        tmp / "cache", log_path=tmp / "server.log")
    try:
        srv.wait_ready(timeout=120)
        yield srv
    finally:
        srv.terminate()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60)


def chat(client, content: str, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


# ------------------------------------------------------------------------------------------------ basic routes

def test_health_ready_models_and_startup_report(server, client):
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.base_url}/ready").status_code == 200
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    report = httpx.get(f"{server.base_url}/startup").json()
    names = [s["name"] for s in report["steps"]]
    assert names[0] == "imports" and names[-1] == "ready"
    assert abs(sum(s["seconds"] for s in report["steps"]) - report["wall_seconds"]) < 0.01
    assert report["plan"]["status"] == "bypassed" and report["weights"]["source"] == "disk"
    assert report["memory"]["num_kv_blocks"] > 0


def test_chat_greedy_is_deterministic_and_counts_usage(client):
    a = chat(client, "Hello world", max_tokens=12, temperature=0)
    b = chat(client, "Hello world", max_tokens=12, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].message.role == "assistant"
    assert a.object == "chat.completion" and a.model == MODEL and a.id.startswith("chatcmpl-")
    assert a.choices[0].finish_reason in ("stop", "length")
    assert a.usage.prompt_tokens > 0 and 1 <= a.usage.completion_tokens <= 12
    assert a.usage.total_tokens == a.usage.prompt_tokens + a.usage.completion_tokens


def test_chat_stream_equals_non_stream_and_reports_usage(client):
    kw = dict(max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    full = chat(client, "The quick brown fox", **kw)
    chunks = list(chat(client, "The quick brown fox", stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_logprobs_have_openai_shape(client):
    r = chat(client, "Paris is", max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
             extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert math.isclose(entry.logprob, entry.top_logprobs[0].logprob, abs_tol=1e-5)   # greedy = argmax
        assert entry.token == entry.top_logprobs[0].token and isinstance(entry.bytes, list)
    streamed = chat(client, "Paris is", max_tokens=6, temperature=0, logprobs=True, top_logprobs=3, stream=True,
                    extra_body={"ignore_eos": True})
    lps = [e.logprob for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert lps == pytest.approx([e.logprob for e in content], abs=1e-5)


def test_chat_n_and_seed(client):
    kw = dict(max_tokens=10, temperature=1.0, seed=1234, n=3, extra_body={"ignore_eos": True})
    a, b = chat(client, "Hello", **kw), chat(client, "Hello", **kw)
    texts = [c.message.content for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in b.choices]               # seeded: reproducible
    assert len(set(texts)) > 1                                            # seed + i: the choices differ
    single = chat(client, "Hello", max_tokens=10, temperature=1.0, seed=1234, extra_body={"ignore_eos": True})
    assert single.choices[0].message.content == texts[0]
    assert a.usage.completion_tokens == 30


def test_chat_content_parts_equal_plain_string(client):
    plain = chat(client, "Hello world", max_tokens=5, temperature=0)
    parts = client.chat.completions.create(model=MODEL, max_tokens=5, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Hello world"}]}])
    assert parts.choices[0].message.content == plain.choices[0].message.content


# ------------------------------------------------------------------------------------------------ completions

def test_completion_prompt_forms_agree(client):
    text = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=8, temperature=0,
                                     logprobs=0, echo=True)
    ids = [1 + i for i in range(5)]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    batch = client.completions.create(model=MODEL, prompt=[ids, "Hello world"], max_tokens=8, temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text == by_ids.choices[0].text
    assert batch.choices[2].text == batch.choices[3].text == text.choices[0].text[len("Hello world"):]
    assert batch.usage.prompt_tokens == 5 + text.usage.prompt_tokens


def test_completion_stop_string_truncates(client):
    base = client.completions.create(model=MODEL, prompt="The quick", max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    candidates = [i for i in range(4, len(base) - 2) if "\ufffd" not in base[i:i + 2] and base[i:i + 2].strip()]
    assert candidates, base
    stop = base[candidates[0]:candidates[0] + 2]
    for stream in (False, True):
        r = client.completions.create(model=MODEL, prompt="The quick", max_tokens=40, temperature=0, stop=[stop],
                                      stream=stream, extra_body={"ignore_eos": True})
        if stream:
            chunks = list(r)
            text = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            text, reason = r.choices[0].text, r.choices[0].finish_reason
        assert text == base[:base.find(stop)] and reason == "stop"


def test_completion_echo_scores_prompt_with_max_tokens_zero(server, client):
    """What evaluation harnesses do: score a continuation's tokens with echo + logprobs + max_tokens 0."""
    gen = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=4, temperature=0, logprobs=1,
                                    extra_body={"ignore_eos": True})
    prompt_ids = _post(server, COMP, {"model": MODEL, "prompt": "Hello world", "max_tokens": 1, "echo": True,
                                      "logprobs": 0}).json()
    n_prompt = gen.usage.prompt_tokens
    assert len(prompt_ids["choices"][0]["logprobs"]["tokens"]) == n_prompt + 1
    scored = client.completions.create(model=MODEL, prompt="Hello world" + gen.choices[0].text, max_tokens=0,
                                       echo=True, logprobs=1)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == "Hello world" + gen.choices[0].text
    assert scored.usage.completion_tokens == 0 and lp.token_logprobs[0] is None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    if lp.tokens[-4:] == gen.choices[0].logprobs.tokens:       # same tokenization: same logprobs, from prefill
        assert lp.token_logprobs[-4:] == pytest.approx(gen.choices[0].logprobs.token_logprobs, abs=1e-4)
    assert gen.choices[0].logprobs.text_offset[0] == len("Hello world")


def test_completion_stream_with_echo_equals_non_stream(client):
    kw = dict(model=MODEL, prompt="The lazy dog", max_tokens=12, temperature=0, echo=True, logprobs=2,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == full.choices[0].logprobs.tokens
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 12


# ------------------------------------------------------------------------------------------------ errors

def _post(server, path: str, body, raw: bool = False) -> httpx.Response:
    content = body if raw else json.dumps(body)
    return httpx.post(f"{server.base_url}{path}", content=content, headers={"content-type": "application/json"},
                      timeout=30)


CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]
MALFORMED = [
    (CHAT, b"{not json", 400), (CHAT, b"", 400), (CHAT, b"[1, 2]", 400), (COMP, b"\xff\xfe", 400),
    (CHAT, {"messages": MSG}, 400),                                           # model missing
    (CHAT, {"model": MODEL}, 400),                                            # messages missing
    (CHAT, {"model": MODEL, "messages": []}, 400),
    (CHAT, {"model": MODEL, "messages": "hi"}, 400),
    (CHAT, {"model": MODEL, "messages": [{"content": "hi"}]}, 400),           # role missing
    (CHAT, {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
    (CHAT, {"model": "gpt-4", "messages": MSG}, 404),
    (CHAT, {"model": MODEL, "messages": MSG, "max_tokens": -1}, 400),
    (CHAT, {"model": MODEL, "messages": MSG, "max_tokens": 0}, 400),
    (CHAT, {"model": MODEL, "messages": MSG, "max_tokens": "ten"}, 400),
    (CHAT, {"model": MODEL, "messages": MSG, "max_tokens": 1.5}, 400),
    (CHAT, {"model": MODEL, "messages": MSG, "max_tokens": MAX_LEN + 5}, 400),
    (CHAT, {"model": MODEL, "messages": MSG, "max_completion_tokens": 10 ** 9}, 400),
    (CHAT, {"model": MODEL, "messages": MSG, "temperature": -1}, 400),
    (CHAT, {"model": MODEL, "messages": MSG, "temperature": "hot"}, 400),
    (CHAT, {"model": MODEL, "messages": MSG, "top_p": 2}, 400),
    (CHAT, {"model": MODEL, "messages": MSG, "top_p": 0}, 400),
    (CHAT, {"model": MODEL, "messages": MSG, "n": 0}, 400),
    (CHAT, {"model": MODEL, "messages": MSG, "n": 10 ** 6}, 400),
    (CHAT, {"model": MODEL, "messages": MSG, "logprobs": True, "top_logprobs": 50}, 400),
    (CHAT, {"model": MODEL, "messages": MSG, "top_logprobs": 2}, 400),        # without logprobs
    (CHAT, {"model": MODEL, "messages": MSG, "stop": ["ok", 3]}, 400),
    (CHAT, {"model": MODEL, "messages": MSG, "stop": [""]}, 400),
    (CHAT, {"model": MODEL, "messages": MSG, "stream": "yes"}, 400),
    (CHAT, {"model": MODEL, "messages": MSG, "stream_options": {"include_usage": True}}, 400),
    (CHAT, {"model": MODEL, "messages": MSG, "seed": "x"}, 400),
    (CHAT, {"model": MODEL, "messages": MSG, "seed": 2 ** 70}, 400),
    (CHAT, {"model": MODEL, "messages": MSG, "presence_penalty": 3.0}, 400),                 # outside [-2, 2]
    (CHAT, {"model": MODEL, "messages": MSG, "logit_bias": {"x": 1}}, 400),
    (CHAT, {"model": MODEL, "messages": MSG, "best_of_n": 2}, 400),                          # unknown field
    (CHAT, {"model": MODEL, "messages": MSG, "tools": [{"type": "function"}]}, 400),
    (CHAT, {"model": MODEL, "messages": MSG, "top_k": -3}, 400),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "word " * 3000}]}, 400),   # prompt too long
    (COMP, {"model": MODEL}, 400),                                            # prompt missing
    (COMP, {"model": MODEL, "prompt": []}, 400),
    (COMP, {"model": MODEL, "prompt": [[]]}, 400),
    (COMP, {"model": MODEL, "prompt": [1, "a"]}, 400),
    (COMP, {"model": MODEL, "prompt": [10 ** 9]}, 400),                      # token id outside the vocabulary
    (COMP, {"model": MODEL, "prompt": [-1]}, 400),
    (COMP, {"model": MODEL, "prompt": [5] * (MAX_LEN + 10)}, 400),            # prompt too long
    (COMP, {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400),           # 0 only with echo
    (COMP, {"model": MODEL, "prompt": "hi", "logprobs": 21}, 400),
    (COMP, {"model": MODEL, "prompt": "hi", "logprobs": True}, 400),
    (COMP, {"model": MODEL, "prompt": "hi", "suffix": "x"}, 400),
    (COMP, {"model": "nope", "prompt": "hi"}, 404),
    ("/v1/nothing", {"model": MODEL}, 404),
]


def test_malformed_requests_get_4xx_with_openai_error_shape(server):
    for path, body, status in MALFORMED:
        r = _post(server, path, body, raw=isinstance(body, bytes))
        assert r.status_code == status, (path, body, r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], (body, err)
    r = httpx.get(f"{server.base_url}/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert server.proc.poll() is None


def test_extreme_but_valid_parameters_are_served(server, client):
    for kw in (dict(temperature=1e-6), dict(temperature=2.0, top_p=1e-9), dict(seed=-5, temperature=1.0),
               dict(extra_body={"top_k": 1, "min_p": 1.0}), dict(logprobs=20, echo=True),
               dict(n=64, temperature=1.0), dict(extra_body={"stop_token_ids": [10 ** 9, 5]})):
        r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, **kw)
        assert all(c.finish_reason in ("stop", "length") for c in r.choices), kw
    r = client.completions.create(model=MODEL, prompt=["Hello", [7, 8]], max_tokens=0, echo=True, n=2)
    assert [c.text for c in r.choices][:2] == ["Hello", "Hello"] and r.usage.completion_tokens == 0
    assert server.metric("warmstart_kv_blocks_used") == 0


def test_context_errors_name_the_numbers(client):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "hi", max_tokens=MAX_LEN)
    msg = e.value.body["message"]
    assert str(MAX_LEN) in msg and "max_tokens" in msg and e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=MSG)
    with pytest.raises(openai.BadRequestError):
        chat(client, "hi", temperature=-1)


# ------------------------------------------------------------------------------------------------ concurrency

def test_concurrent_streams_match_their_solo_outputs(server, client):
    """36 streaming requests at once, chat and completions mixed: each one's greedy output equals the output of
    the same request sent alone, so nothing was lost or crossed between requests."""
    n = 36
    words = "alpha brown fox lazy dog Paris capital France byte world restart every".split()
    reqs = []
    for i in range(n):
        prompt = " ".join(words[(i + j) % len(words)] for j in range(2 + i % 9))
        reqs.append(("chat" if i % 2 else "comp", prompt, 16 + (i * 7) % 33))

    async def one(aclient, kind, prompt, max_tokens, stream):
        kw = dict(model=MODEL, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
        if kind == "chat":
            r = await aclient.chat.completions.create(messages=[{"role": "user", "content": prompt}],
                                                      stream=stream, **kw)
            if not stream:
                return r.choices[0].message.content, r.usage.completion_tokens
            parts = [c.choices[0].delta.content or "" async for c in r if c.choices]
        else:
            r = await aclient.completions.create(prompt=prompt, stream=stream, **kw)
            if not stream:
                return r.choices[0].text, r.usage.completion_tokens
            parts = [c.choices[0].text async for c in r if c.choices]
        return "".join(parts), None

    async def run_all():
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120,
                                      http_client=openai.DefaultAsyncHttpxClient(limits=limits)) as aclient:
            t0 = time.perf_counter()
            together = await asyncio.gather(*(one(aclient, *r, stream=True) for r in reqs))
            wall = time.perf_counter() - t0
            alone = [await one(aclient, *r, stream=False) for r in reqs]
        return together, alone, wall

    before = server.metric("warmstart_generation_tokens_total")
    together, alone, wall = asyncio.run(run_all())
    tokens = sum(t for _, t in alone)
    print(f"\n{n} concurrent streams: {wall:.2f} s wall, {tokens} tokens, {tokens / wall:.0f} tokens/s")
    for i, ((text, _), (solo, _)) in enumerate(zip(together, alone)):
        assert text == solo, (i, reqs[i])
    assert server.metric("warmstart_generation_tokens_total") - before == 2 * tokens
    assert server.metric("warmstart_kv_blocks_used") == 0


# ------------------------------------------------------------------------------------------------ disconnect

def test_disconnect_aborts_the_request_and_frees_its_blocks(server):
    body = {"model": MODEL, "prompt": "Hello world", "max_tokens": MAX_LEN - 20, "n": 4, "temperature": 0,
            "stream": True, "ignore_eos": True}
    label = 'outcome="aborted",route="/v1/completions"'
    aborted_before = server.metric("warmstart_requests_finished_total", label)
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", f"{server.base_url}{COMP}", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [line for line, _ in zip(lines, range(12)) if line.startswith("data:")]
            assert len(got) >= 3
            assert server.metric("warmstart_kv_blocks_used") > 0
    t0 = time.monotonic()          # the connection is closed here
    while time.monotonic() - t0 < 2.0 and server.metric("warmstart_kv_blocks_used") > 0:
        time.sleep(0.05)
    freed_after = time.monotonic() - t0
    print(f"\nKV blocks back to 0 {freed_after * 1000:.0f} ms after the disconnect")
    assert server.metric("warmstart_kv_blocks_used") == 0
    assert server.metric("warmstart_requests_finished_total", label) == aborted_before + 1
    assert server.metric("warmstart_requests_running") == 0


# ------------------------------------------------------------------------------------------------ metrics

def test_metrics_cover_requests_tokens_kv_and_boot(server, client):
    chat(client, "Hello", max_tokens=3, temperature=0)
    text = httpx.get(f"{server.base_url}/metrics").text
    for needle in ('warmstart_http_requests_total{route="/v1/chat/completions",status="200"}',
                   'warmstart_request_latency_seconds_count{route="/v1/chat/completions"}',
                   "warmstart_prompt_tokens_total", "warmstart_generation_tokens_total",
                   "warmstart_kv_blocks_used", "warmstart_kv_blocks_allocated", "warmstart_kv_usage_ratio",
                   'warmstart_startup_step_seconds{step="weights"}', 'warmstart_startup_plan{status="bypassed"}',
                   'warmstart_weights_source{source="disk"}', "warmstart_startup_seconds", "warmstart_ready 1.0"):
        assert needle in text, needle
    assert server.metric("warmstart_kv_blocks_allocated") > 0
    assert 1 <= server.metric("warmstart_step_threads") <= (os.cpu_count() or 1)   # the last step's team
