"""Tools through the official openai client: a tiny random Qwen2-style model with Qwen2.5-Instruct's own chat
template (Hermes ``<tool_call>`` blocks) and the default model's BPE vocabulary. Its words are noise, so the
calls it makes are the grammar's doing: forced calls must parse into ``tool_calls`` and validate."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import torch

from tests.router.conftest import MODEL, running_cluster
from tests.tiny_model import random_weights, tiny_config
from workers.model.llama import LlamaModel
from workers.model.tokenizer import Tokenizer

TEMPLATE = Path(__file__).parent.parent / "chat_templates" / "qwen2_5_instruct.jinja"

# Every value bounded (enums, an integer range, no free strings, no extra keys): a random model at
# temperature 1 finishes such a call in a few dozen tokens.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The forecast for a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days", "unit"],
                   "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                                       "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What will the weather be in Paris?"}]


def tiny_qwen2_model() -> LlamaModel:
    cfg = dataclasses.replace(tiny_config(vocab_size=49152), architecture="qwen2", attention_bias=True)
    weights = random_weights(cfg, seed=5)
    g = torch.Generator().manual_seed(6)
    for i in range(cfg.num_layers):
        for n, heads in (("q", cfg.num_heads), ("k", cfg.num_kv_heads), ("v", cfg.num_kv_heads)):
            weights[f"model.layers.{i}.self_attn.{n}_proj.bias"] = torch.randn(heads * cfg.head_dim, generator=g)
    return LlamaModel(cfg, weights, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def qwen_tokenizer(default_model_and_tokenizer) -> Tokenizer:
    hf = copy.deepcopy(default_model_and_tokenizer[1].hf)
    hf.chat_template = TEMPLATE.read_text()
    return Tokenizer(hf)


@pytest.fixture(scope="module")
def tools_cluster(redis_url, qwen_tokenizer):
    from workers.engine.config import EngineConfig
    from workers.engine.engine import Engine

    model = tiny_qwen2_model()
    with running_cluster(redis_url, lambda: Engine(EngineConfig(max_model_len=2048, num_kv_blocks=512),
                                                   model=model, tokenizer=qwen_tokenizer)) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def client(tools_cluster) -> openai.OpenAI:
    router, _, _ = tools_cluster
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=120)


def assert_valid_call(call) -> dict:  # type: ignore[no-untyped-def]
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return {"name": call.function.name, "arguments": arguments}


def test_the_template_offers_hermes_tool_calls(qwen_tokenizer, default_model_and_tokenizer) -> None:
    assert qwen_tokenizer.tool_call_format == "hermes"
    assert default_model_and_tokenizer[1].tool_call_format is None  # SmolLM2's template takes no tools


def test_a_forced_function_call_parses_into_tool_calls(client) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(4):
        reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named,
                                               temperature=1.0, seed=seed, max_tokens=120)
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice  # as OpenAI ends a forced call
        assert choice.message.content is None and len(choice.message.tool_calls) == 1
        assert assert_valid_call(choice.message.tool_calls[0])["name"] == "get_weather"


def test_required_without_parallel_calls_makes_exactly_one_call(client) -> None:
    names = set()
    for seed in range(6):
        reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                               parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=120)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        names.add(assert_valid_call(choice.message.tool_calls[0])["name"])
    assert names <= {"get_weather", "get_time"}


def test_a_streamed_call_equals_the_whole_one(client) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    for seed in (11, 12):
        whole = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named,
                                               temperature=1.0, seed=seed, max_tokens=120)
        events = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named,
                                                     temperature=1.0, seed=seed, max_tokens=120, stream=True))
        deltas = [d for e in events for d in (e.choices[0].delta.tool_calls or [])]
        assert len(deltas) == 1 and deltas[0].index == 0
        assert not "".join(e.choices[0].delta.content or "" for e in events).strip()
        assert events[-1].choices[0].finish_reason == "stop"
        assert assert_valid_call(deltas[0]) == assert_valid_call(whole.choices[0].message.tool_calls[0])


def test_a_conversation_with_calls_and_answers_renders_as_hf_renders_it(tools_cluster, qwen_tokenizer) -> None:
    router, _, _ = tools_cluster
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2, "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C."}]
    got = httpx.post(f"{router.url}/tokenize", json={"model": MODEL, "messages": messages, "tools": TOOLS},
                     timeout=30).json()
    # HF's own rendering, the arguments as the object templates expect (vLLM hands them over the same way).
    hf_messages = copy.deepcopy(messages)
    hf_messages[1]["content"] = ""
    hf_messages[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris", "days": 2, "unit": "celsius"}
    text = qwen_tokenizer.hf.apply_chat_template(hf_messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert '"name": "get_weather"' in text and "<tool_response>\nSunny, 21 C.\n</tool_response>" in text
    assert got["tokens"] == qwen_tokenizer.hf.encode(text, add_special_tokens=False)


def test_tool_choice_none_leaves_the_tools_out(tools_cluster, client, qwen_tokenizer) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none",
                                           temperature=0, max_tokens=4)
    assert reply.usage.prompt_tokens == len(qwen_tokenizer.apply_chat_template(ASK))
    assert reply.choices[0].message.tool_calls is None


@pytest.mark.parametrize(("body", "says"), [
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among tools"),
    ({"tools": [WEATHER, WEATHER]}, "same name"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "name"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls needs tools"),
    ({"tools": TOOLS, "tool_choice": "required", "ignore_eos": True}, "ignore_eos"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ({"functions": [WEATHER["function"]]}, "functions"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]}, "JSON object"),
])
def test_bad_tool_requests_are_400s_naming_the_problem(tools_cluster, body, says) -> None:
    router, _, _ = tools_cluster
    reply = httpx.post(f"{router.url}/v1/chat/completions", json={"model": MODEL, "messages": ASK, **body}, timeout=30)
    assert reply.status_code == 400, reply.text
    assert says in reply.json()["error"]["message"]


def test_a_model_without_a_tool_format_refuses_tools(local_cluster) -> None:
    router, _, _ = local_cluster
    reply = httpx.post(f"{router.url}/v1/chat/completions", json={"model": MODEL, "messages": ASK, "tools": TOOLS},
                       timeout=30)
    assert reply.status_code == 400 and "no tool-call format" in reply.json()["error"]["message"]
    reply = httpx.post(f"{router.url}/v1/completions", json={"model": MODEL, "prompt": "x", "tools": TOOLS},
                       timeout=30)
    assert reply.status_code == 400 and "tools" in reply.json()["error"]["message"]
