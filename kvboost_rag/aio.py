"""Running blocking generation off the event loop, for the async methods of the framework skins."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


async def run_blocking(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` in the default executor (context variables copied), so the loop keeps ticking."""
    loop = asyncio.get_running_loop()
    ctx = contextvars.copy_context()
    return await loop.run_in_executor(None, lambda: ctx.run(fn, *args, **kwargs))


async def aiter_in_thread(make_iter: Callable[[], Iterator[T]]) -> AsyncIterator[T]:
    """Drive a blocking iterator in a worker thread and yield its items on the event loop, so streaming a
    CPU/GPU-bound generation never blocks the loop."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[bool, Any]] = asyncio.Queue()
    ctx = contextvars.copy_context()

    def worker() -> None:
        try:
            for item in make_iter():
                loop.call_soon_threadsafe(queue.put_nowait, (False, item))
        except BaseException as exc:  # handed to the consumer, re-raised there
            loop.call_soon_threadsafe(queue.put_nowait, (True, exc))
            return
        loop.call_soon_threadsafe(queue.put_nowait, (True, None))

    done = loop.run_in_executor(None, lambda: ctx.run(worker))
    while True:
        finished, item = await queue.get()
        if finished:
            await done
            if item is not None:
                raise item
            return
        yield item
