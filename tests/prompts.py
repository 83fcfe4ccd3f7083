"""Deterministic prompts of chosen token lengths for model tests."""

from __future__ import annotations

_TOPICS = [
    "The river delta formed over thousands of years as sediment settled near the coast.",
    "Bakers in the old town start before dawn, kneading rye dough by lantern light.",
    "A compiler translates source code into machine instructions in several passes.",
    "The orchestra tuned to a single oboe note before the symphony began.",
    "Glaciers carve valleys slowly, leaving moraines of rock where they melt.",
    "Merchants once carried spices, silk and silver along the caravan routes.",
    "In chess, controlling the center early gives the pieces room to move.",
    "Honeybees communicate the direction of flowers through a waggle dance.",
    "The lighthouse keeper logged every passing ship and the weather each night.",
    "Volcanic soil is rich in minerals, which is why vineyards thrive on slopes.",
]


def filler_text(num_words: int, seed: int = 0) -> str:
    words: list[str] = []
    i = seed
    while len(words) < num_words:
        words.extend(_TOPICS[i % len(_TOPICS)].split())
        i += 3
    return " ".join(words[:num_words])


def text_of_tokens(tokenizer, num_tokens: int, seed: int = 0) -> str:
    """Text that encodes to about ``num_tokens`` tokens with ``tokenizer`` (our ``Tokenizer``)."""
    text = filler_text(num_tokens, seed)
    ids = tokenizer.encode(text)
    return tokenizer.decode(ids[:num_tokens])


def reference_prompts(tokenizer) -> list[object]:
    """Eight prompts from ~5 to ~1,500 tokens, raw and chat-templated."""
    def chat(content: str, system: str | None = None) -> dict:
        messages = [{"role": "system", "content": system}] if system else []
        return {"messages": messages + [{"role": "user", "content": content}]}

    return [
        "The capital of France is",
        chat("What is the capital of France?"),
        text_of_tokens(tokenizer, 95, seed=1) + " In summary,",
        chat("Summarize this text in one sentence: " + text_of_tokens(tokenizer, 300, seed=2)),
        text_of_tokens(tokenizer, 640, seed=3),
        chat("What is the main topic?", system="You are a careful reader. " + text_of_tokens(tokenizer, 1000, seed=4)),
        text_of_tokens(tokenizer, 1500, seed=5),
        {"messages": [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue."},
                      {"role": "user", "content": "Name another one and say why you like it."}]},
    ]
