"""`Bus.connect(...)`'s result: awaited, a Bus; used as `async with`, a Bus closed on exit."""

from __future__ import annotations

from collections.abc import Awaitable, Generator
from types import TracebackType
from typing import Any, Generic, Protocol, TypeVar


class Closable(Protocol):
    async def close(self) -> None: ...


B = TypeVar("B", bound=Closable)


class Opening(Generic[B]):
    """`Bus.connect(...)`: await it for a Bus, or use it as `async with` to close on exit."""

    def __init__(self, coro: Awaitable[B]) -> None:
        self._coro = coro
        self._bus: B | None = None

    def __await__(self) -> Generator[Any, None, B]:
        return self._coro.__await__()

    async def __aenter__(self) -> B:
        self._bus = await self._coro
        return self._bus

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._bus is not None:
            await self._bus.close()
