"""Incremental detokenization: stop strings cut across token boundaries, never half a character."""

from __future__ import annotations

import pytest

from workers.engine.detokenizer import IncrementalDetokenizer

TEXT = "The rain in Spain stays mainly in the plain. 東京タワー 🚀🎉 naïve café END of story"


@pytest.fixture(scope="module")
def tokenizer(default_model_and_tokenizer):
    return default_model_and_tokenizer[1]


def feed(tokenizer, token_ids, stop=()):
    det = IncrementalDetokenizer(tokenizer, [1, 2, 3], stop)
    pieces = []
    for t in token_ids:
        pieces.append(det.add_tokens([t]))
        if det.stop_reason:
            break
    pieces.append(det.flush())
    return pieces, det


def test_pieces_join_to_full_decode_and_never_split_a_character(tokenizer):
    ids = tokenizer.encode(TEXT)
    pieces, _ = feed(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces)
    # multi-byte characters really did span several tokens here
    assert len(ids) > len(TEXT.split()) + 10


@pytest.mark.parametrize("stop", ["Spain stays", "ain. 東", "タワ", "🎉 na", "END", "y"])
def test_stop_string_cut_across_token_boundaries(tokenizer, stop):
    ids = tokenizer.encode(TEXT)
    pieces, det = feed(tokenizer, ids, stop=[stop, "never-present"])
    full = tokenizer.decode(ids)
    assert det.stop_reason == stop
    assert "".join(pieces) == full[: full.index(stop)]
    assert stop not in "".join(pieces)


def test_held_back_prefix_released_when_stop_never_comes(tokenizer):
    ids = tokenizer.encode("abc the end")
    pieces, det = feed(tokenizer, ids, stop=["the endgame"])
    assert det.stop_reason is None
    assert "".join(pieces) == tokenizer.decode(ids)
    assert pieces[-1].endswith("the end")  # held back until the flush


def test_engine_stop_string_finishes_with_reason(make_engine):
    engine = make_engine(dense=True)  # the HF-exact path, whose answer is known
    from workers.protocol.sampling_params import SamplingParams

    chat = {"messages": [{"role": "user", "content": "What is the capital of France?"}]}
    full = engine.generate([chat], SamplingParams(max_tokens=32, temperature=0))[0]
    assert full.text == "The capital of France is Paris."
    cut = engine.generate([chat], SamplingParams(max_tokens=32, temperature=0, stop=["of Fr"]))[0]
    assert cut.text == "The capital " and cut.finish_reason == "stop"
    assert engine.block_pool.num_used_blocks == 0


def test_decode_through_the_rust_tokenizer_is_hfs_decode(tokenizer):
    """Tokenizer.decode skips HF's Python wrapper where it adds nothing (no clean-up pass): same text for
    random ids (special tokens and partial UTF-8 among them), with and without skip_special_tokens."""
    import random

    assert tokenizer._rust_decoder is not None  # the bundled model's tokenizer takes the fast path
    rng = random.Random(0)
    vocab = len(tokenizer.hf)
    for _ in range(500):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(0, 12))] + rng.sample(range(10), 2)
        for skip in (True, False):
            assert tokenizer.decode(ids, skip) == tokenizer.hf.decode(ids, skip_special_tokens=skip)


class _WindowOnly:
    """The tokenizer without its Rust incremental decoder: the detokenizer decodes windows itself."""

    def __init__(self, tokenizer, fail_after: int | None = None):
        self.tokenizer, self.fail_after = tokenizer, fail_after

    def decode(self, token_ids, skip_special_tokens=True):
        return self.tokenizer.decode(token_ids, skip_special_tokens)

    def decode_stream(self, context, skip_special_tokens):
        if self.fail_after is None:
            return None
        step, calls = self.tokenizer.decode_stream(context, skip_special_tokens), [0]

        def failing(token_id):
            calls[0] += 1
            if calls[0] > self.fail_after:
                raise RuntimeError("not a prefix")
            return step(token_id)
        return failing


@pytest.mark.parametrize("skip", [True, False])
def test_rust_stream_gives_the_window_decodes_pieces(tokenizer, skip):
    """The Rust incremental decoder emits the same pieces, token by token, as the window decode it replaces;
    where it fails mid-stream the window takes over from where it stood. Random ids: special tokens and
    byte pieces of multi-byte characters among them."""
    import random

    rng = random.Random(1)
    ids = tokenizer.encode(TEXT) + [rng.randrange(len(tokenizer.hf)) for _ in range(300)]
    ids[40:40] = [0, 1, 2]  # special tokens mid-text
    prompt = [5, 1, 7, 2, 9, 10]  # special tokens in the context the first piece is decoded after, too

    def pieces(tok):
        det = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        return [det.add_tokens([t]) for t in ids] + [det.flush()]

    window = pieces(_WindowOnly(tokenizer))
    assert pieces(tokenizer) == window
    for fail_after in (0, 1, 37, 150):
        assert pieces(_WindowOnly(tokenizer, fail_after)) == window
    assert "".join(window) == tokenizer.decode(prompt[-5:] + ids, skip)[len(tokenizer.decode(prompt[-5:], skip)):]
