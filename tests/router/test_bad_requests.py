"""Bad requests get a 4xx in OpenAI's error shape with a message, never a 5xx; tenants never share cache."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from router.schemas import VENDOR_FIELDS
from tests.router.conftest import MODEL

CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
USER = [{"role": "user", "content": "Hello"}]


def chat(**fields):  # type: ignore[no-untyped-def]
    return json.dumps({"model": MODEL, "messages": USER, "max_tokens": 4, **fields}).encode()


def text(**fields):  # type: ignore[no-untyped-def]
    return json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 4, **fields}).encode()


BAD = [
    ("malformed JSON", "POST", CHAT, b'{"model": "x", "messages": [', 400),
    ("invalid UTF-8", "POST", CHAT, b'{"model": "' + bytes([0xFF, 0xFE]) + b'", "messages": []}', 400),
    ("body is a list", "POST", CHAT, b"[1, 2]", 400),
    ("empty body", "POST", TEXT, b"", 400),
    ("max_tokens as a string", "POST", CHAT, chat(max_tokens="5"), 400),
    ("temperature as a word", "POST", TEXT, text(temperature="hot"), 400),
    ("messages as a string", "POST", CHAT, chat(messages="hi"), 400),
    ("negative max_tokens", "POST", TEXT, text(max_tokens=-3), 400),
    ("zero max_completion_tokens", "POST", CHAT, chat(max_completion_tokens=0), 400),
    ("huge n", "POST", CHAT, chat(n=1000), 400),
    ("empty messages", "POST", CHAT, chat(messages=[]), 400),
    ("unknown role", "POST", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), 400),
    ("message without role", "POST", CHAT, chat(messages=[{"content": "hi"}]), 400),
    ("content of the wrong type", "POST", CHAT, chat(messages=[{"role": "user", "content": 42}]), 400),
    ("unknown model", "POST", CHAT, chat(model="gpt-9"), 404),
    ("missing model", "POST", TEXT, json.dumps({"prompt": "hi"}).encode(), 400),
    ("enormous prompt", "POST", TEXT, text(prompt="word " * 200_000), 400),
    ("prompt beyond max_model_len", "POST", TEXT, text(prompt="word " * 2100), 400),
    ("prompt + max_tokens beyond max_model_len", "POST", TEXT, text(max_tokens=2048), 400),
    ("token ids out of the vocabulary", "POST", TEXT, text(prompt=[1, 2, 10**9]), 400),
    ("negative token id", "POST", TEXT, text(prompt=[1, -2]), 400),
    ("empty prompt", "POST", TEXT, text(prompt=""), 400),
    ("several prompts", "POST", TEXT, text(prompt=["a", "b"]), 400),
    ("top_p of zero", "POST", TEXT, text(top_p=0), 400),
    ("temperature too high", "POST", TEXT, text(temperature=7), 400),
    ("too many stop strings", "POST", TEXT, text(stop=[f"s{i}" for i in range(40)]), 400),
    ("an empty stop string", "POST", TEXT, text(stop=[""]), 400),
    ("a penalty out of range", "POST", CHAT, chat(presence_penalty=3.0), 400),
    ("repetition_penalty of zero", "POST", CHAT, chat(repetition_penalty=0), 400),
    ("logit_bias keyed by a word", "POST", CHAT, chat(logit_bias={"hello": 5}), 400),
    ("logit_bias keyed by a superscript digit", "POST", CHAT, chat(logit_bias={"\u00b2": 5}), 400),
    ("logit_bias past the vocabulary", "POST", CHAT, chat(logit_bias={str(10**9): 5}), 400),
    ("logit_bias too strong", "POST", CHAT, chat(logit_bias={"5": 500}), 400),
    ("min_tokens above max_tokens", "POST", CHAT, chat(min_tokens=10), 400),
    ("top_logprobs past 20", "POST", CHAT, chat(logprobs=True, top_logprobs=21), 400),
    ("top_logprobs without logprobs", "POST", CHAT, chat(top_logprobs=3), 400),
    ("completion logprobs past 20", "POST", TEXT, text(logprobs=21), 400),
    ("max_tokens 0 without echo", "POST", TEXT, text(max_tokens=0), 400),
    ("echo on chat", "POST", CHAT, chat(echo=True), 400),
    ("best_of below n", "POST", TEXT, text(n=3, best_of=2), 400),
    ("best_of streamed", "POST", TEXT, text(best_of=2, stream=True), 400),
    ("best_of on chat", "POST", CHAT, chat(best_of=2), 400),
    ("stream as a string", "POST", TEXT, text(stream="yes"), 400),
    ("stream_options without a stream", "POST", CHAT, chat(stream_options={"include_usage": True}), 400),
    ("stream_options on a completion not streamed", "POST", TEXT, text(stream_options={"include_usage": False}), 400),
    ("cache_salt empty", "POST", TEXT, text(cache_salt=""), 400),
    ("prompt_cache_key empty", "POST", CHAT, chat(prompt_cache_key=""), 400),
    ("prompt_cache_key a number", "POST", TEXT, text(prompt_cache_key=7), 400),
    ("an unknown field", "POST", CHAT, chat(length_penalty=1.1), 400),
    ("an unknown field in a message", "POST", CHAT, chat(messages=[{"role": "user", "content": "hi", "x": 1}]), 400),
    ("tools, to a model whose template has none", "POST", CHAT,
     chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400),
    ("response_format of an unknown type", "POST", CHAT, chat(response_format={"type": "yaml"}), 400),
    ("json_schema without its schema's name", "POST", CHAT,
     chat(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}), 400),
    ("a schema xgrammar cannot compile", "POST", CHAT, chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}), 400),
    ("json_object with ignore_eos", "POST", CHAT, chat(response_format={"type": "json_object"}, ignore_eos=True), 400),
    ("stop_token_ids of the wrong type", "POST", TEXT, text(stop_token_ids=["2"]), 400),
    ("an unknown field on /tokenize", "POST", "/tokenize", json.dumps({"model": MODEL, "prompt": "a", "x": 1}).encode(),
     400),
    ("prompt and messages on /tokenize", "POST", "/tokenize", json.dumps({"model": MODEL, "prompt": "a",
                                                                        "messages": USER}).encode(), 400),
    ("token id past the vocabulary on /detokenize", "POST", "/detokenize",
     json.dumps({"model": MODEL, "tokens": [1, 10**9]}).encode(), 400),
    ("GET on a POST route", "GET", CHAT, b"", 405),
    ("unknown route", "POST", "/v1/engines", chat(), 404),
]


@pytest.mark.parametrize(("name", "method", "path", "body", "status"), BAD, ids=[b[0] for b in BAD])
def test_bad_request_is_a_4xx_with_a_message(local_cluster, name, method, path, body, status):
    router, _, _ = local_cluster
    response = httpx.request(method, router.url + path, content=body, timeout=60,
                             headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"], response.text
    assert error["type"]


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"length_penalty": 1.1}, "length_penalty", "Unrecognized request argument supplied: length_penalty"),
    ({"messages": [{"role": "user", "content": "hi", "weight": 1}]}, "messages.0.weight",
     "Unrecognized request argument supplied: messages.0.weight"),
    ({"stream_options": {"include_usage": True, "continuous": True}}, "stream_options.continuous",
     "Unrecognized request argument supplied: stream_options.continuous"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "stream_options: only allowed with stream: true"),
    ({"functions": []}, "functions", "functions: functions is not supported by this server; leave it out or null"),
    ({"store": True}, "store", "store: store is not supported by this server"),
])
def test_a_field_not_implemented_is_refused_by_name(local_cluster, fields, param, message):
    router, _, _ = local_cluster
    response = httpx.post(router.url + CHAT, content=chat(**fields), timeout=60,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(message), error


def test_the_readme_lists_every_vendor_field() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert all(f"`{name}`" in readme for name in VENDOR_FIELDS), [n for n in VENDOR_FIELDS if f"`{n}`" not in readme]


def test_null_for_a_field_not_implemented_is_accepted(local_cluster):
    """Some clients send every field of OpenAI's API, null where unset: that asks for nothing."""
    router, _, _ = local_cluster
    response = httpx.post(router.url + CHAT, content=chat(functions=None, function_call=None, store=None),
                          timeout=60, headers={"Content-Type": "application/json"})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"]


def test_cache_salt_isolates_tenants(local_cluster, make_engine):
    router, prefill, decode = local_cluster
    prompt = "Tenant data: " + "the quick brown fox jumps over the lazy dog " * 12

    def hits() -> int:
        totals = [s.loop.call(lambda e: e.stats().prefix_hit_tokens_total) for s in (prefill, decode)]
        return sum(t.result(timeout=10) for t in totals)

    def cached(salt: str | None) -> int:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
        if salt is not None:
            body["cache_salt"] = salt
        reply = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60).json()
        return int(reply["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 0  # the same tenant reuses its prefix
    before = hits()
    assert cached("tenant-b") == 0
    assert cached(None) == 0
    assert hits() == before  # no block of tenant a served anyone else, on either worker
