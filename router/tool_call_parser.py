"""Hermes-style tool calls read out of a model's text as it streams.

    parser = ToolCallParser()
    content, calls = parser.feed(text_piece)   # text safe to show now; calls completed by this piece
    content, calls = parser.finish()           # at the end: what was held back

Text that might be the start of ``<tool_call>`` is held back until it is known not to be. A block whose
body is not a JSON object with a "name" is shown as text, as it came.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"


class ToolCallParser:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []  # OpenAI's message.tool_calls entries, in order
        self.content = ""  # all the text that is not a call
        self._pending = ""  # text not yet classified
        self._in_call = False

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self._pending += text
        shown, new_calls = [], []
        while True:
            if self._in_call:
                end = self._pending.find(CALL_END)
                if end < 0:
                    break
                body, self._pending = self._pending[:end], self._pending[end + len(CALL_END):]
                self._in_call = False
                call = _parse_call(body)
                if call is None:
                    shown.append(CALL_START + body + CALL_END)
                else:
                    new_calls.append(call)
                continue
            start = self._pending.find(CALL_START)
            if start >= 0:
                shown.append(self._pending[:start])
                self._pending = self._pending[start + len(CALL_START):]
                self._in_call = True
                continue
            keep = _partial_start(self._pending)
            shown.append(self._pending[: len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep:]
            break
        return self._record("".join(shown), new_calls)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The end of the output: an unclosed call that still parses (cut at ``</tool_call>``) counts."""
        pending, self._pending = self._pending, ""
        if not self._in_call:
            return self._record(pending, [])
        self._in_call = False
        call = _parse_call(pending)
        return self._record("", [call]) if call is not None else self._record(CALL_START + pending, [])

    def _record(self, shown: str, calls: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
        self.content += shown
        self.calls.extend(calls)
        return shown, calls


def _partial_start(text: str) -> int:
    """How many trailing characters of ``text`` could begin ``<tool_call>``."""
    for n in range(min(len(text), len(CALL_START) - 1), 0, -1):
        if CALL_START.startswith(text[-n:]):
            return n
    return 0


def _parse_call(body: str) -> dict[str, Any] | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": value["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}
