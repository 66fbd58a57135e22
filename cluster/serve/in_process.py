"""Objects that the Ingress replica builds in its own process in place of another deployment's
replicas: the engine (`engine_in_ingress: true` in the app config), and the TenantLedger where
there is one Ingress replica.

    default:            client -> Ingress replica --Ray call per message--> LLMServer replica (engine)
    engine_in_ingress:  client -> Ingress replica (its own LLMServer, called in process)

Every message of a stream otherwise crosses one Ray call between two replicas; on a small node
that hop's CPU (serialization, Ray's threads in both processes, two event loop wakeups) comes out
of the engine's step: 1-2 ms of a 7-13 ms token at one stream on 2 cores (docs/benchmarks-log.md).
With the option each Ingress replica builds its own LLMServer, and the Ingress calls it through
LocalHandle, which offers the part of a DeploymentHandle the Ingress uses. The Ingress deployment
then scales as the LLMServer deployment would (its replicas are the engines).

The TenantLedger keeps the tenants' running requests and charges in one place: a deployment of
its own where several Ingress replicas share it, the Ingress's own object where there is one
(two Ray calls a request, and one process waking ~150 times a second even when idle, fewer).
"""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass
from typing import Any

from ray.serve.exceptions import RequestCancelledError


@dataclass(frozen=True)
class InProcess:
    """What build_app hands the Ingress in place of a handle to a deployment: that deployment's
    class and arguments; the Ingress replica builds the object itself (`build`)."""

    cls: type
    kwargs: dict[str, Any]

    def build(self):
        return self.cls(**self.kwargs)


class LocalHandle:
    """`handle.method.remote(...)` and `handle.options(stream=True).method.remote(...)` over an
    object in this process, as Serve's DeploymentHandle offers them over a deployment."""

    def __init__(self, target, stream: bool = False):
        self._target, self._stream = target, stream

    def options(self, stream: bool = False, _by_reference: bool = True) -> LocalHandle:
        """`_by_reference`, how Serve carries a call's values between processes, has nothing to
        carry in process."""
        return LocalHandle(self._target, stream)

    def __getattr__(self, name: str) -> _LocalMethod:
        return _LocalMethod(getattr(self._target, name), self._stream)


class _LocalMethod:
    def __init__(self, method, stream: bool):
        self._method, self._stream = method, stream

    def remote(self, *args, **kwargs):
        if self._stream:
            return LocalStream(self._method(*args, **kwargs))
        return asyncio.ensure_future(self._call(*args, **kwargs))

    async def _call(self, *args, **kwargs):
        result = self._method(*args, **kwargs)
        return await result if inspect.isawaitable(result) else result


class LocalStream:
    """An async generator of this process as a Serve response stream: iterated, and `cancel()`ed
    from any task of the loop (the tenant's cancellation arrives on another task than the one
    reading): the generator's pending step is cancelled, so its own cleanup (the LLMServer aborts
    the request) runs, and the reader gets RequestCancelledError, as from Serve."""

    def __init__(self, generator):
        self._generator = generator
        self._step: asyncio.Future | None = None
        self._cancelled = False

    def __aiter__(self) -> LocalStream:
        return self

    async def __anext__(self):
        if self._cancelled:
            await self._generator.aclose()  # cancelled while the reader held the last message
            raise RequestCancelledError("the stream was cancelled")
        self._step = asyncio.ensure_future(self._generator.__anext__())
        try:
            return await self._step
        except asyncio.CancelledError:  # the step cancelled by `cancel`, or with its reader (asyncio does that)
            if self._cancelled and not _current_task_cancelling():
                raise RequestCancelledError("the stream was cancelled") from None
            raise
        finally:
            self._step = None

    def cancel(self) -> None:
        self._cancelled = True
        if self._step is not None and not self._step.done():
            self._step.cancel()
        else:  # between steps (or never started): close it, which runs its cleanup now
            asyncio.ensure_future(self._generator.aclose())


def _current_task_cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
