"""Tandem workers: everything that runs inside a prefill or decode worker, and the vocabulary the
router shares with them.

Subpackages, lowest first (each imports only those above it in this list, and ``kernels``):
    protocol/   wire messages, sampling parameters, block hashes, KV events, Redis keys, errors
    model/      the Llama-family model, its config, weight loading, the tokenizer
    transport/  moving KV blocks between workers (tcp, nixl, nccl)
    engine/     one engine: scheduler, paged KV block pool, model runner, sampler, detokenizer
    service/    the engine on its thread, the prefill and decode services, publishing, metrics
``actors.py`` wraps the services as Ray actors; ``resources.py`` says what an actor asks Ray for.
"""
