"""The official openai client against a router over real HTTP; text equals a single engine's."""

from __future__ import annotations

import socket
import time

import httpx
import openai
import pytest

from tests.router.conftest import MODEL
from workers.protocol.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def client(local_cluster):
    router, _, _ = local_cluster
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=120)


def held_blocks(service) -> int:  # type: ignore[no-untyped-def]
    return service.loop.call(lambda e: e.block_pool.num_used_blocks).result(timeout=10)


def wait_idle(*services, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while any(held_blocks(s) for s in services) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(held_blocks(s) == 0 for s in services)


QUESTIONS = ["What is the capital of France?", "Write one sentence about the sea. " * 6]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_greedy_text_equals_the_engine(client, local_cluster, make_engine, stream):
    _, prefill, decode = local_cluster
    engine = make_engine()
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        want = engine.generate([{"messages": messages}], SamplingParams(max_tokens=24, temperature=0.0))[0]
        if stream:
            events = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                                         temperature=0, stream=True,
                                                         stream_options={"include_usage": True}))
            text = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
            finish = [e.choices[0].finish_reason for e in events if e.choices and e.choices[0].finish_reason]
            usage = events[-1].usage
            assert events[0].choices[0].delta.role == "assistant" and not events[-1].choices
        else:
            reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
            text, finish, usage = reply.choices[0].message.content, [reply.choices[0].finish_reason], reply.usage
        assert text == want.text
        assert finish == [want.finish_reason if want.finish_reason == "length" else "stop"]
        assert usage.prompt_tokens == len(want.prompt_token_ids)
        assert usage.completion_tokens == len(want.token_ids)
    wait_idle(prefill, decode)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_text_and_token_prompts(client, local_cluster, make_engine, stream):
    engine = make_engine()
    prompt = "The three primary colours are"
    want = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0]
    for given in (prompt, want.prompt_token_ids):
        if stream:
            events = list(client.completions.create(model=MODEL, prompt=given, max_tokens=12, temperature=0,
                                                    stream=True))
            text = "".join(e.choices[0].text for e in events)
        else:
            reply = client.completions.create(model=MODEL, prompt=given, max_tokens=12, temperature=0)
            text = reply.choices[0].text
            assert reply.usage.completion_tokens == 12
        assert text == want.text


def test_stop_seed_and_logprobs(client, make_engine):
    engine = make_engine()
    prompt = "List the numbers: 1, 2, 3,"
    full = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0))[0].text
    stop = full.strip()[3:6]
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=[stop])
    assert reply.choices[0].finish_reason == "stop" and reply.choices[0].text == full[: full.index(stop)]
    seeded = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0, seed=7)
              .choices[0].text for _ in range(2)]
    want = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=1.0, seed=7))[0].text
    assert seeded == [want, want]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=5, temperature=0, logprobs=True)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(c.logprob <= 0 for c in content)
    text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=0)
    assert len(text.choices[0].logprobs.token_logprobs) == 4


def test_stop_token_ids_skip_special_tokens_and_stop_reason(client, make_engine):
    engine = make_engine()
    prompt = "List the numbers: 1, 2, 3,"
    full = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0]
    stop_id = full.token_ids[4]
    cut = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_id]))[0]
    assert len(cut.token_ids) < len(full.token_ids)  # the engine honours it: now the router must pass it on
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body={"stop_token_ids": [stop_id]})
    choice = reply.choices[0]
    assert choice.text == cut.text and reply.usage.completion_tokens == len(cut.token_ids)
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop_id
    stop = full.text.strip()[3:6]
    by_string = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop])
    assert by_string.choices[0].model_extra["stop_reason"] == stop
    by_length = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
    assert by_length.choices[0].finish_reason == "length" and by_length.choices[0].model_extra["stop_reason"] is None
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                         extra_body={"stop_token_ids": [stop_id]})
    last = [c for c in streamed if c.choices][-1].choices[0]
    assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == stop_id


def test_skip_special_tokens_reaches_the_worker(client, make_engine):
    engine = make_engine()
    tokenizer = engine.tokenizer
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}])
    out = engine.generate([ids], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0]
    # The answer ends its turn and, EOS ignored, goes on: special tokens are among the output.
    assert set(tokenizer.hf.all_special_ids) & set(out.token_ids)
    # A salt of its own: no prefix cached by other tests' chats (computed in other chunks, rounded otherwise).
    kept, dropped = (client.completions.create(model=MODEL, prompt=ids, max_tokens=40, temperature=0,
                                               extra_body={"ignore_eos": True, "skip_special_tokens": skip,
                                                           "cache_salt": f"special-{skip}"})
                     .choices[0].text for skip in (False, True))
    assert kept == tokenizer.decode(out.token_ids, skip_special_tokens=False)
    assert dropped == tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert kept != dropped


def test_penalties_logit_bias_and_min_tokens_reach_the_workers(client, make_engine):
    engine = make_engine()
    prompt = "one two one two one two one two one two one two"  # > 8 tokens: prefilled on p0, decoded on d0
    penalized = SamplingParams(max_tokens=16, temperature=0.0, frequency_penalty=1.5, presence_penalty=0.5,
                               repetition_penalty=1.2)
    want = engine.generate([prompt], penalized)[0].text
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                      frequency_penalty=1.5, presence_penalty=0.5,
                                      extra_body={"repetition_penalty": 1.2})
    assert reply.choices[0].text == want
    assert want != engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0))[0].text
    eos = engine.tokenizer.eos_token_id
    ended = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                      logit_bias={str(eos): 100})
    assert ended.usage.completion_tokens == 1 and ended.choices[0].finish_reason == "stop"
    # min_tokens holds EOS back from the first token too, which the prefill worker samples.
    held = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                     logit_bias={str(eos): 100}, extra_body={"min_tokens": 3})
    assert held.usage.completion_tokens == 4 and held.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_top_logprobs_equal_the_engines(client, make_engine, stream):
    engine = make_engine()
    tokenizer = engine.tokenizer
    question = "Name three colours of the rainbow."  # long enough to be prefilled on p0: its first token too
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}])
    want = engine.generate([ids], SamplingParams(max_tokens=6, temperature=0.0, logprobs=True, top_logprobs=5))[0]
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                           max_tokens=6, temperature=0, logprobs=True, top_logprobs=5,
                                           stream=stream)
    if stream:
        content = [c for chunk in reply if chunk.choices and chunk.choices[0].logprobs
                   for c in chunk.choices[0].logprobs.content]
    else:
        content = reply.choices[0].logprobs.content
    assert len(content) == len(want.token_ids) == len(want.top_logprobs) == 6
    for entry, token_id, top in zip(content, want.token_ids, want.top_logprobs, strict=True):
        assert entry.token == tokenizer.decode([token_id], skip_special_tokens=False)
        assert [(t.token, t.logprob) for t in entry.top_logprobs] == [
            (tokenizer.decode([t], skip_special_tokens=False), lp) for t, lp in top]
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy: the chosen token is the likeliest
    text = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0, logprobs=2)
    tops = text.choices[0].logprobs.top_logprobs
    assert [list(top.values()) for top in tops] == [[lp for _, lp in top[:2]] for top in want.top_logprobs[:3]]


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_share_the_prompt_and_seed_each_choice(client, local_cluster, make_engine, stream):
    _, prefill, decode = local_cluster
    engine = make_engine()
    prompt = "Write a short line about the sea and the wind over it. " * 3  # three full blocks and more
    num_prompt = len(engine.tokenizer.encode(prompt))
    want = [engine.generate([prompt], SamplingParams(max_tokens=8, temperature=1.0, seed=11 + i))[0].text
            for i in range(3)]
    hits_before = decode.loop.call(lambda e: e.stats().prefix_hit_tokens_total).result(timeout=10)
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0, seed=11, n=3,
                                      stream=stream, stream_options={"include_usage": True} if stream else None)
    if stream:
        texts, finishes, usage = ["", "", ""], [None] * 3, None
        for chunk in reply:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                texts[choice.index] += choice.text
                finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    else:
        assert sorted(c.index for c in reply.choices) == [0, 1, 2]
        ordered = sorted(reply.choices, key=lambda c: c.index)
        texts, finishes, usage = [c.text for c in ordered], [c.finish_reason for c in ordered], reply.usage
    assert texts == want  # choice i sampled with seed 11 + i
    assert len(set(texts)) > 1 and finishes == ["length"] * 3
    assert usage.prompt_tokens == num_prompt and usage.completion_tokens == 24
    # Choices 1 and 2 started over the prompt blocks choice 0 left in the decode worker's prefix cache.
    hits = decode.loop.call(lambda e: e.stats().prefix_hit_tokens_total).result(timeout=10) - hits_before
    assert hits >= 2 * (num_prompt // 16) * 16
    wait_idle(prefill, decode)


def test_best_of_returns_the_likeliest_sequences_per_token(client, make_engine):
    engine = make_engine()
    prompt = "Name a colour and say why you like it."
    drawn = [engine.generate([prompt], SamplingParams(max_tokens=10, temperature=1.0, seed=5 + i, logprobs=True))[0]
             for i in range(4)]
    mean = [sum(out.logprobs) / len(out.logprobs) for out in drawn]
    want = sorted(range(4), key=lambda i: mean[i], reverse=True)[:2]
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=1.0, seed=5, n=2,
                                      best_of=4)
    assert [c.index for c in reply.choices] == [0, 1] and all(c.logprobs is None for c in reply.choices)
    assert [c.text for c in reply.choices] == [drawn[i].text for i in want]
    assert reply.usage.completion_tokens == sum(len(out.token_ids) for out in drawn)  # all four were decoded
    with_logprobs = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=1.0, seed=5,
                                              best_of=4, logprobs=0)
    assert with_logprobs.choices[0].logprobs.token_logprobs == pytest.approx(drawn[want[0]].logprobs, abs=1e-4)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_gives_the_prompt_and_its_logprobs_first(client, local_cluster, make_engine, stream):
    """lm-eval's loglikelihood request (echo, max_tokens 0, logprobs) and echo before generated text."""
    _, prefill, decode = local_cluster
    engine = make_engine()
    prompt = "The quick brown fox jumps over the lazy dog, and then it runs into the woods to rest."
    ids = engine.tokenize(prompt)
    want = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, logprobs=True, top_logprobs=2,
                                                    prompt_logprobs=2))[0]
    assert want.prompt_logprobs is not None

    def ask(max_tokens: int):  # type: ignore[no-untyped-def]
        reply = client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=max_tokens, logprobs=2,
                                          temperature=0, stream=stream)
        if not stream:
            return reply.choices[0].text, reply.choices[0].logprobs, reply.choices[0].finish_reason
        text, logprobs, finish = "", {"tokens": [], "token_logprobs": [], "top_logprobs": []}, None
        for event in reply:
            choice = event.choices[0]
            text += choice.text
            finish = choice.finish_reason or finish
            for key in logprobs:
                logprobs[key] += getattr(choice.logprobs, key) if choice.logprobs else []
        return text, type("Logprobs", (), logprobs), finish

    text, logprobs, finish = ask(0)
    assert text == prompt and finish == "length"
    assert logprobs.tokens == [engine.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1:] == pytest.approx([lp for lp, _ in want.prompt_logprobs], abs=1e-4)
    assert [len(top) for top in logprobs.top_logprobs[1:]] == [2] * (len(ids) - 1)
    text, logprobs, finish = ask(6)
    assert text == prompt + want.text and len(logprobs.tokens) == len(ids) + 6
    assert logprobs.token_logprobs[len(ids):] == pytest.approx(want.logprobs, abs=1e-4)
    reply = client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=3, temperature=0)
    assert reply.choices[0].text.startswith(prompt) and reply.choices[0].logprobs is None
    assert reply.usage.completion_tokens == 3
    wait_idle(prefill, decode)


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_outputs_validate(client, stream):
    """Prompts long enough to be prefilled on p0: the first token, sampled there, obeys the schema too.
    Ten seeded requests at temperature 1.0 at once (batched on d0), whole and streamed: 20 in all."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    import jsonschema

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0}},
              "required": ["city", "population"], "additionalProperties": False}

    def ask(seed: int) -> str:
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Name a large city and its population, as JSON."}],
            max_tokens=60, temperature=1.0, seed=seed, stream=stream,
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema,
                                                                    "strict": True}})
        if stream:
            return "".join(c.choices[0].delta.content or "" for c in reply if c.choices)
        assert reply.choices[0].finish_reason == "stop"
        return str(reply.choices[0].message.content)

    with ThreadPoolExecutor(10) as pool:
        texts = list(pool.map(ask, range(10)))
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    assert len(set(texts)) > 1  # sampled, not one answer ten times
    sea = [{"role": "user", "content": "Give me a JSON object with the name and colour of the sea."}]
    reply = client.chat.completions.create(model=MODEL, max_tokens=200, temperature=0, messages=sea,
                                           response_format={"type": "json_object"})
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_tokenize_detokenize_round_trip_and_version(local_cluster, make_engine):
    router, _, _ = local_cluster
    tokenizer = make_engine().tokenizer
    text = "Tandem serves tokens, one at a time."
    got = httpx.post(f"{router.url}/tokenize", json={"model": MODEL, "prompt": text}).json()
    assert got == {"tokens": tokenizer.encode(text), "count": len(tokenizer.encode(text)), "max_model_len": 2048}
    back = httpx.post(f"{router.url}/detokenize", json={"model": MODEL, "tokens": got["tokens"]}).json()
    assert back == {"prompt": tokenizer.decode(got["tokens"], skip_special_tokens=False)}
    assert text in back["prompt"]
    messages = [{"role": "user", "content": "Hi"}]
    chat = httpx.post(f"{router.url}/tokenize", json={"model": MODEL, "messages": messages}).json()
    assert chat["tokens"] == tokenizer.apply_chat_template(messages)
    version = httpx.get(f"{router.url}/version").json()["version"]
    assert version.count(".") >= 2


def test_models_health_ready_metrics(local_cluster):
    router, _, _ = local_cluster
    models = httpx.get(f"{router.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL] and models["data"][0]["max_model_len"] == 2048
    assert time.time() - 3600 < models["data"][0]["created"] <= time.time()  # when this router loaded it
    assert httpx.get(f"{router.url}/health").status_code == 200
    ready = httpx.get(f"{router.url}/ready").json()
    assert ready["ready"] and ready["decode_workers"] == 1 and ready["prefill_workers"] == 1
    text = httpx.get(f"{router.url}/metrics").text
    assert 'tandem_router_requests_total{endpoint="/v1/chat/completions",status="200"}' in text
    assert f'tandem_kv_blocks_total{{model_name="{MODEL}",role="decode",worker_id="d0"}}' in text
    assert f'tandem_kv_blocks_total{{model_name="{MODEL}",role="prefill",worker_id="p0"}}' in text
    assert text.count("# TYPE tandem_kv_blocks_total gauge") == 1


def test_client_disconnect_cancels_on_every_worker(local_cluster):
    """A client gone mid-stream, or gone before a non-streamed answer, frees the request's blocks at once: within
    1.5 s, where its 1,900 tokens would take seconds more (~2 ms a token on a 2-core host; 400 once all came within
    the client's 1 s)."""
    router, prefill, decode = local_cluster
    body = {"model": MODEL, "prompt": "Count slowly: one, two,", "max_tokens": 1900, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert held_blocks(decode) > 0
    wait_idle(prefill, decode, timeout_s=1.5)
    body["stream"] = False  # a non-streamed request whose client gives up
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{router.url}/v1/completions", json=body, timeout=1.0)
    wait_idle(prefill, decode, timeout_s=1.5)


def test_failed_transfer_is_retried_as_a_local_prefill(local_cluster, client, make_engine):
    router, prefill, decode = local_cluster
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there: every transfer to the decode worker is refused
    decode.transport.address = lambda: {"backend": "tcp", "host": "127.0.0.1", "port": port}  # type: ignore[method-assign]
    prompt = "Retry me: " + "a long enough prompt for a remote prefill " * 3
    try:
        reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    finally:
        del decode.transport.address
    want = make_engine().generate([prompt], SamplingParams(max_tokens=6, temperature=0.0))[0].text
    assert reply.choices[0].text == want
    assert "tandem_router_retries_total 1.0" in httpx.get(f"{router.url}/metrics").text
    wait_idle(prefill, decode)


def test_a_full_pool_queues_and_a_full_queue_is_a_429_with_retry_after(local_cluster):
    """The router never refuses for room (every block promised here): the decode worker queues. Past
    the queue's bounds the request is shed with 429 + Retry-After, counted by reason; a 503 is only for
    no worker of a role."""
    router, prefill, decode = local_cluster
    accounting = router.app.state.router.dispatcher._inflight.kv_blocks
    accounting["d0"] = 10**6
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
    try:
        assert httpx.post(f"{router.url}/v1/completions", timeout=60, json=body).status_code == 200
    finally:
        del accounting["d0"]
    config = decode.loop.engine.config
    for knob, value, reason in (("max_queue_len", 0, "queue_full"), ("max_queue_time_s", 0.0, "queue_timeout")):
        setattr(config, knob, value)
        try:
            response = httpx.post(f"{router.url}/v1/completions", timeout=30, json=body)
        finally:
            setattr(config, knob, None)
        assert response.status_code == 429 and response.headers["Retry-After"] == "1", response.text
        assert response.json()["error"]["code"] == f"overloaded_{reason}"
        assert f'tandem_router_rejections_total{{reason="{reason}"}} 1.0' in httpx.get(f"{router.url}/metrics").text
    wait_idle(prefill, decode)
    assert httpx.post(f"{router.url}/v1/completions", timeout=60, json=body).status_code == 200
