"""Tools on chat completions: the functions reach the chat template, and what the model writes is held
to the template's tool-call format by a grammar (xgrammar's structural tag, in the batched sampler).

Tandem reads the Hermes format (Qwen2, Hermes and many fine-tunes write it)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``tool_choice``:
- ``"auto"`` (the default with tools): free text, and any ``<tool_call>`` the model opens is forced to
  name one of the tools and to give arguments that match its ``parameters`` schema, so a call always
  parses (vLLM leaves auto unconstrained, and a small model's calls then often do not parse);
- ``"required"``: one or more calls and nothing else;
- a named function: exactly one call of it (``finish_reason`` "stop", as OpenAI answers a forced call);
- ``"none"``: the tools are left out of the prompt and nothing is parsed.
``parallel_tool_calls: false`` ends the output after the first call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from router.schemas import ChatCompletionRequest, NamedToolChoice, ToolDefinition
from router.tool_call_parser import CALL_END, CALL_START
from workers.model.tokenizer import Tokenizer
from workers.protocol.errors import InvalidRequestError


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean for its prompt, its grammar and its parsing."""

    tools: list[dict[str, Any]]  # in OpenAI's shape, as chat templates take them
    structural_tag: str  # xgrammar's structural tag (JSON text)
    forced: bool  # a named function was required: one call, finish_reason "stop"
    parallel: bool  # more than one call may come


def template_tools(tools: list[ToolDefinition] | None, tokenizer: Tokenizer) -> list[dict[str, Any]] | None:
    """The tools as the chat template takes them; a 400 where the model's template writes no calls Tandem
    can read."""
    if not tools:
        return None
    if tokenizer.tool_call_format != "hermes":
        raise InvalidRequestError("tools: this model's chat template has no tool-call format Tandem reads "
                                  "(Hermes-style <tool_call> blocks, as Qwen2's template writes them)")
    return [tool.model_dump(exclude_none=True) for tool in tools]


def tool_plan(body: ChatCompletionRequest, tokenizer: Tokenizer) -> ToolPlan | None:
    """None where the request offers no tools or ``tool_choice`` is "none"."""
    if not body.tools or body.tool_choice == "none":
        return None
    tools = template_tools(body.tools, tokenizer)
    assert tools is not None
    parallel = body.parallel_tool_calls is not False
    choice = body.tool_choice
    if isinstance(choice, NamedToolChoice):
        named = next(t for t in body.tools if t.function.name == choice.function.name)
        form: dict[str, Any] = _call_tag(named)
    elif choice == "required":
        form = {"type": "tags_with_separator", "tags": [_call_tag(t) for t in body.tools], "separator": "\n",
                "at_least_one": True, "stop_after_first": not parallel}
    else:  # auto
        form = {"type": "triggered_tags", "triggers": [CALL_START], "tags": [_call_tag(t) for t in body.tools],
                "at_least_one": False, "stop_after_first": not parallel}
    tag = json.dumps({"type": "structural_tag", "format": form})
    return ToolPlan(tools, tag, forced=isinstance(choice, NamedToolChoice), parallel=parallel)


def _call_tag(tool: ToolDefinition) -> dict[str, Any]:
    """One function's call: the Hermes wrapper around arguments that match its parameters schema."""
    name = json.dumps(tool.function.name)
    schema = tool.function.parameters if tool.function.parameters is not None else {"type": "object"}
    # One whitespace character at most between JSON tokens: the format writes arguments on one line, and a
    # small model let free would wander in spaces and newlines until max_tokens.
    content = {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}
    return {"type": "tag", "begin": f'{CALL_START}\n{{"name": {name}, "arguments": ', "content": content,
            "end": f"}}\n{CALL_END}"}
