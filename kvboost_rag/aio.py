"""Running blocking generation off the event loop, for the async methods of the framework skins."""

from __future__ import annotations

import asyncio
import contextvars
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


def thread_setting() -> Callable[[], None]:
    """Capture the calling thread's torch thread count; the returned function applies it in another thread.

    Why: torch.set_num_threads in the main thread does not reach threads started later, which begin at
    OpenMP's default (every core): a call run in a worker thread then sums in another order and its logits
    differ from the same call made sequentially (2.3e-5 measured). Cheap when already equal."""
    torch = sys.modules.get("torch")  # not imported here: no model has run if torch is not loaded yet
    if torch is None:
        return lambda: None
    n = torch.get_num_threads()

    def apply() -> None:
        # set, not compared: torch.get_num_threads() may report the process-wide value while this thread's
        # OpenMP still holds its default; once per thread and count (set_num_threads is not free)
        if getattr(_applied, "n", None) != n:
            torch.set_num_threads(n)
            _applied.n = n

    return apply


_applied = threading.local()  # the thread count thread_setting last applied in each thread


async def run_blocking(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` in the default executor (context variables copied, the caller's torch thread
    count applied), so the loop keeps ticking."""
    loop = asyncio.get_running_loop()
    ctx = contextvars.copy_context()
    threads = thread_setting()

    def call() -> T:
        threads()
        return ctx.run(fn, *args, **kwargs)

    return await loop.run_in_executor(None, call)


async def aiter_in_thread(make_iter: Callable[[], Iterator[T]]) -> AsyncIterator[T]:
    """Drive a blocking iterator in a worker thread and yield its items on the event loop, so streaming a
    CPU/GPU-bound generation never blocks the loop."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[bool, Any]] = asyncio.Queue()
    ctx = contextvars.copy_context()
    threads = thread_setting()

    def worker() -> None:
        threads()
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
