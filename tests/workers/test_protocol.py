"""Wire messages: typed end to end (nested dataclasses come back as themselves), strict on unknown
fields, and a SamplingParams that arrives invalid is refused naming its field."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from workers.protocol.errors import InvalidRequestError
from workers.protocol.messages import GenerateRequest, PrefillRequest, TokenChunk, pack, pack_list, unpack, unpack_list
from workers.protocol.sampling_params import SamplingParams, check_fits


def test_sampling_params_travel_as_themselves():
    params = SamplingParams(max_tokens=7, temperature=0.5, top_k=3, seed=11, stop=["\n\n"], logprobs=True)
    request = GenerateRequest("r1", [1, 2, 3], params, "tenant-a", "p0")
    back = unpack(GenerateRequest, pack(request))
    assert back == request and isinstance(back.sampling, SamplingParams)
    prefill = PrefillRequest("r1", [1, 2], params, None, {"host": "h", "port": 1}, [4, 5], 1, 3.0)
    assert unpack(PrefillRequest, pack(prefill)).sampling == params


def test_packed_as_dataclasses_asdict_packs_them():
    """``pack`` reads fields without ``dataclasses.asdict``'s deep copies: the same bytes, nested dataclass,
    lists of pairs and None included."""
    request = GenerateRequest("r1", [1, 2], SamplingParams(max_tokens=3, stop=["x"], seed=4), None)
    chunks = [TokenChunk("r1", [7, 8], " a", [-0.5, -1.5], top_logprobs=[[(7, -0.5), (9, -2.0)], [(8, -1.5)]],
                         prompt_logprobs=[(-3.0, [(2, -1.0)])], queue_seconds=0.25),
              TokenChunk("r1", finished=True, finish_reason="stop", stop_reason=2, num_output_tokens=2)]
    assert pack(request) == msgpack.packb(dataclasses.asdict(request), use_bin_type=True)
    assert pack_list(chunks) == msgpack.packb([dataclasses.asdict(c) for c in chunks], use_bin_type=True)
    assert unpack(GenerateRequest, pack(request)) == request
    back = unpack_list(TokenChunk, pack_list(chunks))
    assert [c.token_ids for c in back] == [[7, 8], []] and back[1].stop_reason == 2


def test_unknown_fields_and_invalid_params_are_refused():
    data = msgpack.packb({"request_id": "r", "prompt_token_ids": [1], "sampling": {"max_tokens": 4, "beam": 2}})
    with pytest.raises(ValueError, match=r"SamplingParams: unknown fields \['beam'\]"):
        unpack(GenerateRequest, data)
    data = msgpack.packb({"request_id": "r", "prompt_token_ids": [1], "sampling": {"max_tokens": -1}})
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        unpack(GenerateRequest, data)
    with pytest.raises(ValueError, match="unknown fields"):
        unpack(TokenChunk, msgpack.packb({"request_id": "r", "extra": 1}))


def test_one_length_rule():
    check_fits(100, 28, 128)
    with pytest.raises(InvalidRequestError, match=r"prompt \(100 tokens\) \+ max_tokens \(29\) = 129 exceeds "
                                                  r"max_model_len 128"):
        check_fits(100, 29, 128)
