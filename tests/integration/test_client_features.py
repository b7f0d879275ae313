"""What agent frameworks and vLLM users send, against a real server: tool calls, structured outputs, sampling
controls, template switches, tokenizer routes; with the official openai client, LangChain and LiteLLM.

The model is a tiny random Qwen3 with a Hermes-style tool template: it knows nothing, so everything asserted about
its structured output is what constrained decoding guarantees."""
from __future__ import annotations

import json
import os
from typing import Literal

import httpx
import openai
import pydantic
import pytest

from tests.checkpoints import write_checkpoint
from tests.integration.server_process import ServerProcess
from tests.integration.tool_template import use_tool_template

MODEL = "tiny-qwen3"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
FORCE_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("features")
    ckpt = use_tool_template(write_checkpoint(tmp / MODEL, "qwen3", max_position=1024))
    srv = ServerProcess(ckpt, "--kv-cache-memory", "32MiB", "--max-model-len", 1024, "--cache-dir", tmp / "cache",
                        log_path=tmp / "server.log")
    try:
        srv.wait_ready(timeout=120)
        yield srv
    finally:
        srv.terminate()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def rendered(server, messages: list[dict], **kw) -> str:
    ids = httpx.post(f"{server.base_url}/tokenize", json={"messages": messages, **kw}).json()["tokens"]
    return httpx.post(f"{server.base_url}/detokenize", json={"tokens": ids}).json()["prompt"]


# ------------------------------------------------------------------------------------------------ tool calls

@pytest.mark.parametrize("stream", [False, True])
def test_sdk_tool_call_round_trip(server, client, stream):
    kw = dict(model=MODEL, tools=[WEATHER], max_tokens=60, temperature=1.0, seed=7)
    messages = user("What is the weather in Paris?")
    if stream:
        chunks = list(client.chat.completions.create(messages=messages, tool_choice=FORCE_WEATHER, stream=True,
                                                     **kw))
        calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
            ["tool_calls"]
        assert len(calls) == 1 and calls[0].index == 0 and calls[0].id.startswith("call_")
        name, args, call_id = calls[0].function.name, calls[0].function.arguments, calls[0].id
    else:
        r = client.chat.completions.create(messages=messages, tool_choice=FORCE_WEATHER, **kw)
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        call = r.choices[0].message.tool_calls[0]
        name, args, call_id = call.function.name, call.function.arguments, call.id
    assert name == "get_weather"
    parsed = json.loads(args)
    assert parsed["city"] in ("Paris", "Rome", "Oslo") and 1 <= parsed["days"] <= 7
    history = messages + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "sunny, 21 C"}]
    prompt = rendered(server, history, tools=[WEATHER])
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt             # the tool turn was rendered
    assert '"name": "get_weather", "arguments": {"city"' in prompt               # arguments as an object
    final = client.chat.completions.create(messages=history, tool_choice="none", **kw)
    assert final.choices[0].message.tool_calls is None and final.choices[0].message.content
    assert final.usage.prompt_tokens == len(httpx.post(f"{server.base_url}/tokenize", json={
        "messages": history}).json()["tokens"])                                 # none: tools not in the prompt


def test_required_tool_choice_always_calls(client):
    other = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"type": "string", "maxLength": 6}}, "required": ["q"],
        "additionalProperties": False}}}
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=user("hi"), tools=[WEATHER, other],
                                           tool_choice="required", parallel_tool_calls=False, max_tokens=200,
                                           temperature=1.0, seed=seed)
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
        for c in calls:
            assert c.function.name in ("get_weather", "lookup")
            assert isinstance(json.loads(c.function.arguments), dict)


def test_tools_reach_the_template_and_bad_tool_choices_are_400(server):
    assert '"name": "get_weather"' in rendered(server, user("hi"), tools=[WEATHER])
    for body in ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                 {"tool_choice": "required"}, {"tools": [{"type": "web_search"}]},
                 {"tools": [WEATHER], "tool_choice": "sometimes"},
                 {"tools": [WEATHER], "tool_choice": FORCE_WEATHER, "response_format": {"type": "json_object"}}):
        r = httpx.post(f"{server.base_url}/v1/chat/completions",
                       json={"model": MODEL, "messages": user("hi"), **body})
        assert r.status_code == 400, (body, r.text)


# ------------------------------------------------------------------------------------------------ structured outputs

class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    population: int = pydantic.Field(ge=0, le=10 ** 7)
    capital: bool


class Step(pydantic.BaseModel):
    action: Literal["go", "stop", "wait"]
    note: str = pydantic.Field(max_length=8)


class Plan(pydantic.BaseModel):
    steps: list[Step] = pydantic.Field(max_length=3)
    done: bool


class Scores(pydantic.BaseModel):
    best: Literal["a", "b"]
    margin: float = pydantic.Field(ge=0, le=1)


@pytest.mark.parametrize("schema", [City, Plan, Scores])
def test_parse_returns_valid_objects(client, schema):
    for seed in range(3):
        r = client.chat.completions.parse(model=MODEL, messages=user("Give me JSON."), response_format=schema,
                                          max_tokens=300, temperature=1.0, seed=seed)
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(r.choices[0].message.parsed, schema)


def test_every_structured_output_spelling(server, client):
    # Any object: a random model may write one key for ever, so only a finished output must parse.
    r = client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=80,
                                       response_format={"type": "json_object"}, temperature=0)
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    for extra, check in (
            ({"guided_choice": ["red", "green"]}, lambda t: t in ("red", "green")),
            ({"guided_regex": r"\d{3}-[a-z]{2}"}, lambda t: len(t) == 6 and t[3] == "-" and t[:3].isdigit()),
            ({"guided_json": {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"]}},
             lambda t: isinstance(json.loads(t)["x"], bool)),
            ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no"))):
        r = client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=40, temperature=1.0,
                                           seed=3, extra_body=extra)
        assert check(r.choices[0].message.content), (extra, r.choices[0].message.content)
    c = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=10, temperature=1.0,
                                  extra_body={"guided_choice": ["alpha", "beta"]})
    assert c.choices[0].text in ("alpha", "beta")
    for bad in ({"guided_regex": "[a-"}, {"guided_json": {"type": "nonsense"}},
                {"guided_choice": ["a"], "guided_regex": "a"}, {"response_format": {"type": "xml"}},
                {"structured_outputs": {"cfg": "x"}}):
        r = httpx.post(f"{server.base_url}/v1/chat/completions",
                       json={"model": MODEL, "messages": user("hi"), **bad})
        assert r.status_code == 400, (bad, r.text)


def test_constrained_stream_equals_non_stream(client):
    kw = dict(model=MODEL, messages=user("hi"), response_format=City, max_tokens=300, temperature=1.0, seed=11)
    full = client.chat.completions.parse(**kw).choices[0].message.content
    kw["response_format"] = {"type": "json_schema", "json_schema": {
        "name": "City", "schema": openai.lib._pydantic.to_strict_json_schema(City), "strict": True}}
    chunks = client.chat.completions.create(stream=True, **kw)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full


# ------------------------------------------------------------------------------------------------ sampling controls

def test_sampling_controls_change_output_as_defined(server, client):
    base = dict(model=MODEL, messages=user("Hello"), max_tokens=12, temperature=0)
    plain = client.chat.completions.create(**base)
    tok = httpx.post(f"{server.base_url}/tokenize", json={"prompt": " Paris", "add_special_tokens": False}).json()
    forced = tok["tokens"][0]
    biased = client.chat.completions.create(**base, logit_bias={str(forced): 100},
                                            extra_body={"ignore_eos": True}, logprobs=True)
    assert {e.token for e in biased.choices[0].logprobs.content} == {
        httpx.post(f"{server.base_url}/detokenize", json={"tokens": [forced]}).json()["prompt"]}
    # frequency/presence/repetition penalties forbid the repetition a huge bias would otherwise force
    pen = client.chat.completions.create(**base, logit_bias={str(forced): 5}, frequency_penalty=2.0,
                                         presence_penalty=2.0, extra_body={"ignore_eos": True,
                                                                           "repetition_penalty": 3.0})
    assert pen.choices[0].message.content != biased.choices[0].message.content
    eos = httpx.get(f"{server.base_url}/tokenizer_info").json()["eos_token_id"]
    early = client.chat.completions.create(**base, logit_bias={str(eos): 100})
    assert early.usage.completion_tokens == 1 and early.choices[0].finish_reason == "stop"
    late = client.chat.completions.create(**base, logit_bias={str(eos): 100}, extra_body={"min_tokens": 4})
    assert late.usage.completion_tokens == 5 and late.choices[0].finish_reason == "stop"
    text = plain.choices[0].message.content
    if len(text) > 4:
        stop = text[2:4]
        kept = client.chat.completions.create(**base, stop=[stop], extra_body={"include_stop_str_in_output": True})
        assert kept.choices[0].message.content.endswith(stop)


def test_template_switches_truncation_and_prompt_logprobs(server, client):
    msgs = user("Hello")
    on = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1)
    off = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens > on.usage.prompt_tokens                     # the empty think block
    assert rendered(server, msgs, chat_template_kwargs={"enable_thinking": False}).endswith("</think>\n\n")
    assert not rendered(server, msgs, add_generation_prompt=False).endswith("assistant\n")
    cont = msgs + [{"role": "assistant", "content": "The answer is"}]
    assert rendered(server, cont, continue_final_message=True, add_generation_prompt=False).endswith(
        "The answer is")
    r = client.chat.completions.create(model=MODEL, messages=cont, max_tokens=1,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert r.choices[0].finish_reason in ("stop", "length")
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1,
                                       extra_body={"truncate_prompt_tokens": 3, "prompt_logprobs": 2})
    assert r.usage.prompt_tokens == 3
    plp = r.model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == 3 and all(len(e) >= 1 for e in plp[1:])
    raw = client.completions.create(model=MODEL, prompt="Hello world again", max_tokens=1,
                                    extra_body={"truncate_prompt_tokens": 2})
    assert raw.usage.prompt_tokens == 2


def test_unknown_fields_are_400_and_known_no_ops_are_fine(server, client):
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json={
        "model": MODEL, "messages": user("hi"), "max_tokens": 1, "best_of_n": 2, "guided_whitespace": 1})
    assert r.status_code == 400
    err = r.json()["error"]
    assert "best_of_n" in err["message"] and "guided_whitespace" in err["message"]
    assert err["code"] == "unsupported_parameter"
    ok = client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=1, user="u1",
                                        metadata={"k": "v"}, store=False)
    assert ok.choices[0].finish_reason in ("stop", "length")


# ------------------------------------------------------------------------------------------------ tokenizer routes

def test_tokenizer_routes_and_version(server):
    base = server.base_url
    t = httpx.post(f"{base}/tokenize", json={"model": MODEL, "prompt": "Hello world", "return_token_strs": True})
    body = t.json()
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"]) > 0 and body["max_model_len"] == 1024
    assert httpx.post(f"{base}/detokenize", json={"tokens": body["tokens"]}).json() == {"prompt": "Hello world"}
    info = httpx.get(f"{base}/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and "tool_call" in info["chat_template"]
    assert httpx.get(f"{base}/version").json()["version"]
    assert httpx.post(f"{base}/detokenize", json={"tokens": [10 ** 9]}).status_code == 400
    assert httpx.post(f"{base}/tokenize", json={"prompt": "a", "messages": user("b")}).status_code == 400


# ------------------------------------------------------------------------------------------------ LangChain, LiteLLM

def test_langchain_bind_tools_and_structured_output(server):
    from langchain_openai import ChatOpenAI
    llm = ChatOpenAI(model=MODEL, base_url=f"{server.base_url}/v1", api_key="x", max_tokens=200, temperature=1.0,
                     seed=5, max_retries=0)

    class GetWeather(pydantic.BaseModel):
        """Weather in a city for some days."""
        city: Literal["Paris", "Rome"]
        days: int = pydantic.Field(ge=1, le=7)

    # strict: additionalProperties false, so a random model cannot wander off into keys of its own
    msg = llm.bind_tools([GetWeather], tool_choice="GetWeather", strict=True).invoke("Weather in Rome?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "GetWeather"
    assert msg.tool_calls[0]["args"]["city"] in ("Paris", "Rome")
    city = llm.with_structured_output(City).invoke("A city, please.")           # json_schema by default
    assert isinstance(city, City)
    city = llm.with_structured_output(City, method="function_calling").invoke("A city, please.")
    assert isinstance(city, City)


def test_litellm_completion_and_tools(server):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")            # no network fetch at import
    import litellm
    kw = dict(model=f"openai/{MODEL}", api_base=f"{server.base_url}/v1", api_key="x", max_tokens=60)
    r = litellm.completion(messages=user("Hello"), temperature=0, **kw)
    text = r.choices[0].message.content
    assert text is not None and r.usage.prompt_tokens > 0
    r = litellm.completion(messages=user("Weather?"), tools=[WEATHER], tool_choice=FORCE_WEATHER, **kw)
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments)["city"] in ("Paris", "Rome", "Oslo")
    chunks = list(litellm.completion(messages=user("Hello"), temperature=0, stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text


# ------------------------------------------------------------------------------------------------ /v1/responses

def test_responses_text_and_stream(client):
    kw = dict(model=MODEL, instructions="Be brief.", input="Hello", max_output_tokens=8, temperature=0)
    r = client.responses.create(**kw)
    assert r.object == "response" and r.status in ("completed", "incomplete")
    assert r.output[0].type == "message" and r.output_text == r.output[0].content[0].text
    assert r.usage.input_tokens > 0 and 1 <= r.usage.output_tokens <= 8
    chat = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}])
    assert r.output_text == chat.choices[0].message.content                  # the same request underneath
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output_text == r.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


@pytest.mark.parametrize("stream", [False, True])
def test_responses_function_call_round_trip(server, client, stream):
    tool = {"type": "function", "name": "get_weather", **{k: WEATHER["function"][k]
                                                          for k in ("description", "parameters")}}
    kw = dict(model=MODEL, tools=[tool], max_output_tokens=60, temperature=1.0)
    first = kw | dict(input="Weather in Oslo?", tool_choice={"type": "function", "name": "get_weather"})
    if stream:
        events = list(client.responses.create(stream=True, **first))
        out = events[-1].response.output
        assert any(e.type == "response.function_call_arguments.done" for e in events)
    else:
        out = client.responses.create(**first).output
    call = next(o for o in out if o.type == "function_call")
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Rome", "Oslo")
    follow = [{"role": "user", "content": "Weather in Oslo?"},
              {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
              {"type": "function_call_output", "call_id": call.call_id, "output": "cold"}]
    r = client.responses.create(input=follow, tool_choice="none", **kw)
    assert r.output[0].type == "message"
    r = httpx.post(f"{server.base_url}/v1/responses", json={"model": MODEL, "input": "hi",
                                                           "previous_response_id": "resp_1"})
    assert r.status_code == 400 and "previous_response_id" in r.json()["error"]["message"]
