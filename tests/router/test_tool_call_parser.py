"""Hermes tool calls read out of streamed text, and the grammar that holds the model to them."""

from __future__ import annotations

import json
import random

import pytest

from router.schemas import ChatCompletionRequest
from router.tool_call_parser import ToolCallParser
from router.tool_calls import tool_plan
from tests.router.test_tools import ASK, TOOLS
from workers.engine.structured_output import StructuredOutputs
from workers.protocol.sampling_params import SamplingParams

CALL_1 = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3, "unit": "celsius"}}\n'
          "</tool_call>")
CALL_2 = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
NOT_A_CALL = "<tool_call>\nnot json\n</tool_call>"
TEXT = f"Let me look <to that up.\n{CALL_1}\n{NOT_A_CALL}\n{CALL_2}\n"


def parse_in_pieces(text: str, cuts: list[int]) -> tuple[str, list[dict], str]:
    parser, shown = ToolCallParser(), ""
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        piece, _ = parser.feed(text[a:b])
        shown += piece
    piece, _ = parser.finish()
    return shown + piece, parser.calls, parser.content


def test_any_split_of_the_text_gives_the_same_calls_and_content() -> None:
    whole_shown, whole_calls, whole_content = parse_in_pieces(TEXT, [])
    assert whole_shown == whole_content == f"Let me look <to that up.\n\n{NOT_A_CALL}\n\n"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole_calls] == [
        ("get_weather", {"city": "Oslo", "days": 3, "unit": "celsius"}), ("get_time", {"zone": "CET"})]
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(TEXT)), rng.randint(1, 30)))
        shown, calls, content = parse_in_pieces(TEXT, cuts)
        assert (shown, content) == (whole_shown, whole_content)
        assert [c["function"] for c in calls] == [c["function"] for c in whole_calls]


def test_a_possible_start_is_held_back_until_it_is_not_one() -> None:
    parser = ToolCallParser()
    assert parser.feed("The answer <tool") == ("The answer ", [])
    assert parser.feed("box> is") == ("<toolbox> is", [])
    shown, calls = parser.feed(" here " + CALL_2[:30])
    assert shown == " here " and not calls
    shown, calls = parser.feed(CALL_2[30:])
    assert shown == "" and [c["function"]["name"] for c in calls] == ["get_time"]


def test_an_unclosed_call_counts_only_if_it_parses() -> None:
    parser = ToolCallParser()
    parser.feed(CALL_2.removesuffix("\n</tool_call>"))
    assert parser.finish()[1][0]["function"]["name"] == "get_time"
    parser = ToolCallParser()
    parser.feed(CALL_2[:40])
    assert parser.finish() == (CALL_2[:40], [])


@pytest.fixture(scope="module")
def grammars(default_model_and_tokenizer) -> tuple[StructuredOutputs, object]:
    tokenizer = default_model_and_tokenizer[1]
    return StructuredOutputs(tokenizer.hf, tokenizer.vocab_size), tokenizer


def accepts(grammars, tool_choice: object, text: str, parallel: bool = True) -> bool:  # type: ignore[no-untyped-def]
    outputs, tokenizer = grammars
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": ASK, "tools": TOOLS,
                                                 "tool_choice": tool_choice, "parallel_tool_calls": parallel})
    plan = tool_plan(body, _HermesTokenizer())
    matcher = outputs.matcher(SamplingParams(structural_tag=plan.structural_tag))
    ids = tokenizer.hf.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    return all(matcher.accept_token(t) for t in ids)


class _HermesTokenizer:
    tool_call_format = "hermes"


def test_auto_lets_text_through_and_holds_calls_to_their_schemas(grammars) -> None:
    assert accepts(grammars, "auto", "No tool needed: it is sunny.")
    assert accepts(grammars, "auto", f"Checking.\n{CALL_1}\n{CALL_2}")
    assert not accepts(grammars, "auto", CALL_1.replace("Oslo", "Rome"))  # not in the enum
    assert not accepts(grammars, "auto", CALL_2.replace("get_time", "get_date"))  # no such tool
    assert not accepts(grammars, "auto", f"{CALL_1}\n{CALL_2}", parallel=False)  # one call, then the end


def test_required_and_named_allow_calls_only(grammars) -> None:
    assert accepts(grammars, "required", f"{CALL_1}\n{CALL_2}")
    assert not accepts(grammars, "required", "Sunny.")
    assert not accepts(grammars, "required", f"Checking.\n{CALL_1}")
    named = {"type": "function", "function": {"name": "get_time"}}
    assert accepts(grammars, named, CALL_2)
    assert not accepts(grammars, named, CALL_1)
