"""Per-request sampling parameters, validated where they are built: a ``SamplingParams`` that exists is
valid, whether the router built it from an HTTP body or a worker unpacked it from the wire."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from workers.protocol.errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0  # with logprobs: this many likeliest alternatives of each token, up to MAX_TOP_LOGPROBS
    skip_special_tokens: bool = True
    # Each prompt token's log probability given the tokens before it (the first has none), with this many
    # likeliest alternatives; None: not computed. Computed where the request decodes, over the whole prompt
    # (its prefix-cache hits are not used: a cached block has no logits).
    prompt_logprobs: int | None = None
    # Logit adjustments, with vLLM's definitions (workers/engine/penalties.py): presence and frequency
    # penalties count output tokens, the repetition penalty prompt and output tokens alike.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: list[tuple[int, float]] = field(default_factory=list)  # (token id, bias added to its logit)
    min_tokens: int = 0  # EOS and stop_token_ids are held back until this many tokens are out
    # Structured output: a JSON schema (as JSON text) every output must match, enforced by token masks
    # (workers/engine/structured_output.py); OpenAI's json_object is the schema {"type": "object"}.
    json_schema: str | None = None
    # Or an xgrammar structural tag (JSON text): free text and tagged JSON sections, as tool calls are
    # written (router/tool_calls.py builds them).
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        self._validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_grammar(self) -> bool:
        return self.json_schema is not None or self.structural_tag is not None

    @property
    def adjusts_logits(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)

    def _validate(self) -> None:
        """Raise ``InvalidRequestError`` naming the first bad field."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise InvalidRequestError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequestError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop must be a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be non-negative integers")
        if isinstance(self.top_logprobs, bool) or not isinstance(self.top_logprobs, int) \
                or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], "
                                      f"got {self.top_logprobs!r}")
        if self.prompt_logprobs is not None and (isinstance(self.prompt_logprobs, bool)
                                                 or not isinstance(self.prompt_logprobs, int)
                                                 or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS):
            raise InvalidRequestError(f"prompt_logprobs must be null or an integer in [0, {MAX_TOP_LOGPROBS}], "
                                      f"got {self.prompt_logprobs!r}")
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise InvalidRequestError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if any(len(pair) != 2 or isinstance(pair[0], bool) or not isinstance(pair[0], int) or pair[0] < 0
               or not -100.0 <= pair[1] <= 100.0 for pair in self.logit_bias):
            raise InvalidRequestError("logit_bias maps token ids (non-negative integers) to biases in [-100, 100]")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise InvalidRequestError(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        if self.json_schema is not None:
            _check_json_object(self.json_schema, "response_format: the schema")
        if self.structural_tag is not None:
            _check_json_object(self.structural_tag, "the structural tag")
        if self.json_schema is not None and self.structural_tag is not None:
            raise InvalidRequestError("response_format cannot be combined with forced or automatic tool calls")
        if self.has_grammar and (self.ignore_eos or self.min_tokens):
            # The grammar ends on EOS; holding it back would leave no token to sample.
            what = "response_format" if self.json_schema is not None else "tool calls"
            raise InvalidRequestError(f"{what} cannot be combined with ignore_eos or min_tokens")
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(f"min_tokens ({self.min_tokens}) exceeds max_tokens ({self.max_tokens})")


def _check_json_object(text: str, what: str) -> None:
    """A schema or tag must be a JSON object (xgrammar says the rest when it compiles it)."""
    try:
        value = json.loads(text)
    except (TypeError, json.JSONDecodeError) as e:
        raise InvalidRequestError(f"{what} is not JSON: {e}") from e
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{what} must be a JSON object")


def check_fits(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """The one length rule, where the router builds a request and where an engine admits one."""
    total = num_prompt_tokens + max_tokens
    if total > max_model_len:
        raise InvalidRequestError(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} exceeds "
            f"max_model_len {max_model_len}")
