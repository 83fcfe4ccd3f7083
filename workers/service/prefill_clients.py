"""Ways a decode worker reaches prefill workers: direct calls in one process, Ray actors in a cluster."""

from __future__ import annotations

from workers.protocol.errors import TransferError
from workers.protocol.messages import PrefillRequest, PrefillResult, pack, unpack
from workers.service.named_actors import NamedActors
from workers.service.prefill import PrefillService


class LocalPrefillClient:
    """Prefill services living in this process, by worker id (tests, single-process runs)."""

    def __init__(self, services: dict[str, PrefillService] | None = None):
        self.services = services if services is not None else {}

    async def prefill(self, worker_id: str, request: PrefillRequest) -> PrefillResult:
        return await self.services[worker_id].prefill(request)

    async def cancel(self, worker_id: str, request_id: str) -> None:
        await self.services[worker_id].cancel(request_id)


class RayPrefillClient:
    """Prefill workers as named Ray actors; handles are looked up once and kept.

    A prefill worker that is gone (drained, died) is a ``TransferError``: the router then retries the
    request as a local prefill on the decode worker instead of failing it.
    """

    def __init__(self, namespace: str | None = None):
        self.namespace = namespace
        self._actors = NamedActors(namespace, lambda w: TransferError(f"prefill worker {w!r} is gone"))

    async def prefill(self, worker_id: str, request: PrefillRequest) -> PrefillResult:
        import ray

        try:
            data = await self._actors.get(worker_id).prefill.remote(pack(request))
        except ray.exceptions.RayActorError as e:
            self._actors.forget(worker_id)
            raise TransferError(f"prefill worker {worker_id!r} is gone: {e}") from e
        return unpack(PrefillResult, data)

    async def cancel(self, worker_id: str, request_id: str) -> None:
        await self._actors.get(worker_id).cancel.remote(request_id)
