"""Handles of named Ray actors in one namespace, looked up once and kept until forgotten (routers
reach decode workers, decode workers reach prefill workers, both by worker id)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class NamedActors:
    def __init__(self, namespace: str | None, missing: Callable[[str], Exception]):
        """``missing(name)``: the error to raise when no actor has that name (each caller's own kind)."""
        self.namespace = namespace
        self._missing = missing
        self._handles: dict[str, Any] = {}

    def get(self, name: str) -> Any:
        handle = self._handles.get(name)
        if handle is None:
            import ray

            try:
                handle = self._handles[name] = ray.get_actor(name, namespace=self.namespace)
            except ValueError as e:
                raise self._missing(name) from e
        return handle

    def forget(self, name: str) -> None:
        """The actor died or left: look it up afresh next time."""
        self._handles.pop(name, None)
