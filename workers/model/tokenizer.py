"""Tokenizer and chat template from the model's own source (GGUF metadata or HF directory).

Uses transformers' tokenizer classes so that encoding and chat templating are exactly HF's.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from workers.model.loader import ModelSource
from workers.protocol.errors import InvalidRequestError, ModelLoadError

_ROLES = {"system", "user", "assistant", "tool", "developer"}


class Tokenizer:
    def __init__(self, hf_tokenizer: Any):
        self.hf = hf_tokenizer
        self.eos_token_id: int | None = hf_tokenizer.eos_token_id
        self.vocab_size = len(hf_tokenizer)
        # The Rust tokenizer where HF's decode would add nothing to it (no clean-up pass): a decode step
        # detokenizes every running request twice, and HF's Python wrapper was most of that cost.
        rust = getattr(hf_tokenizer, "_tokenizer", None)
        self._rust_decoder = rust if rust is not None and not getattr(
            hf_tokenizer, "clean_up_tokenization_spaces", True) else None

    @classmethod
    def load(cls, source: ModelSource) -> Tokenizer:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub
        from transformers import AutoTokenizer

        try:
            if source.kind == "gguf":
                tok = AutoTokenizer.from_pretrained(str(source.directory), gguf_file=source.path.name)
            else:
                tok = AutoTokenizer.from_pretrained(str(source.path))
        except Exception as e:  # transformers raises many kinds on a bad directory
            raise ModelLoadError(f"cannot load tokenizer from {source.path}: {e}") from e
        return cls(tok)

    def encode(self, text: str) -> list[int]:
        """A raw prompt, with the special tokens the model's tokenizer adds by default."""
        return list(self.hf.encode(text))

    def apply_chat_template(self, messages: Sequence[dict[str, Any]],
                            tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
        """Chat messages (and the functions the model may call, in OpenAI's tool shape) rendered with the
        model's template plus the generation prompt, as HF does."""
        validate_messages(messages)
        text = self.hf.apply_chat_template(list(messages), tools=list(tools) if tools else None, tokenize=False,
                                           add_generation_prompt=True)
        return list(self.hf.encode(text, add_special_tokens=False))

    @property
    def tool_call_format(self) -> str | None:
        """How the chat template has the model write tool calls: "hermes" (``<tool_call>{json}</tool_call>``,
        as Qwen2 and Hermes do), or None where the template takes no tools or writes them another way."""
        template = self.hf.chat_template
        if isinstance(template, dict):  # named templates: the default one renders chats
            template = template.get("default")
        if not isinstance(template, str) or "tools" not in template:
            return None
        return "hermes" if "<tool_call>" in template else None

    def decode_stream(self, context: Sequence[int], skip_special_tokens: bool) -> Callable[[int], str | None] | None:
        """The Rust tokenizer's incremental decoder after ``context``: each token's newly final text, or None
        while it is not yet (half a character). None where HF's decode is not the Rust one's (see __init__)."""
        if self._rust_decoder is None:
            return None
        from tokenizers.decoders import DecodeStream

        stream = DecodeStream(list(context), skip_special_tokens=skip_special_tokens)
        return partial(stream.step, self._rust_decoder)  # a C-level call a token, no Python frame

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._rust_decoder is not None:
            return str(self._rust_decoder.decode(list(token_ids), skip_special_tokens=skip_special_tokens))
        return str(self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens))


def validate_messages(messages: Sequence[dict[str, Any]]) -> None:
    if not messages:
        raise InvalidRequestError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise InvalidRequestError(f"messages[{i}].role must be one of {sorted(_ROLES)}")
        if not isinstance(m.get("content"), str):
            raise InvalidRequestError(f"messages[{i}].content must be a string")
