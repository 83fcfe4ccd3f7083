"""Tandem workers: the inference engine, KV block pool, scheduler and (later) Ray actors.

The shared vocabulary that routers import (block hashes, KV events) lives here too.
"""
