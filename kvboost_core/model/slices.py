"""A long model call run in slices: on its own thread, but only while its owner's thread waits for it, and
handing control back between two layers once a slice's work is spent.

Why: a server runs all model work on one engine thread, between decode steps. Warming a document is one
forward pass per document (``KVEngine.warm``); cutting it into token chunks would change the bits of the KV it
stores (other GEMM shapes), so the same document warmed in process and in a server would differ. Pausing the
unchanged computation between layers changes nothing: the same kernels run on the same tensors, and a running
stream waits for at most one slice (about ``budget`` token-layers / layers) between two of its tokens.

The two threads never run model code at the same time: :meth:`SlicedCall.step` blocks its caller until the
slice pauses or the call ends. The pause points are :func:`layer_done` calls, which
:func:`kvboost_core.model.forward.run_forward` makes after every layer; on any thread without a sliced call they do
nothing. A call that reaches no pause point (a model without layer-wise forwards) runs whole in one step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

_LOCAL = threading.local()  # .hook: the running SlicedCall's per-layer callback on its thread


def layer_done(rows: int, layers: int) -> None:
    """A forward finished one of its ``layers`` layers for ``rows`` positions: a pause point."""
    _pause_point(rows / layers)


def checkpoint() -> None:
    """A pause point between two pieces of work (e.g. two documents): pauses if the slice's budget is spent."""
    _pause_point(0.0)


def _pause_point(work: float) -> None:
    hook: Callable[[float], None] | None = getattr(_LOCAL, "hook", None)
    if hook is not None:
        hook(work)


class Interrupted(BaseException):
    """Raised at a pause point inside a call that was closed before it ended (a BaseException, so that no
    ``except Exception`` on the way out turns it into a result)."""


class SlicedCall:
    """``fn()`` on its own daemon thread, advanced by :meth:`step` from the owner's thread.

    ``setup`` runs first on the new thread (e.g. applying the owner's torch thread count, which does not reach
    threads started later). Work is counted in token equivalents: a layer over ``n`` positions of an ``L``-layer
    model is ``n / L``, so a budget of ``T`` is about ``T`` tokens through the whole model per step."""

    __slots__ = ("_fn", "_setup", "_thread", "_resume", "_paused", "_budget", "_spent", "_deadline", "_closing",
                 "_done", "_result", "_error", "steps")

    def __init__(self, fn: Callable[[], Any], *, setup: Callable[[], None] | None = None,
                 name: str = "kvboost-sliced-call") -> None:
        self._fn, self._setup = fn, setup
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._resume = threading.Semaphore(0)  # owner -> call: run the next slice
        self._paused = threading.Semaphore(0)  # call -> owner: paused, or ended
        self._budget = self._spent = 0.0
        self._deadline: float | None = None
        self._closing = self._done = False
        self._result: Any = None
        self._error: BaseException | None = None
        self.steps = 0  # slices run so far

    @property
    def done(self) -> bool:
        return self._done

    def step(self, budget: float, seconds: float | None = None) -> bool:
        """Run the call until about ``budget`` token equivalents are computed, or (when given) ``seconds`` have
        passed, at the first pause point after either (at least one layer); or until it ends. Returns
        :attr:`done`. Call it from one thread at a time."""
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0:
            raise ValueError(f"budget must be a number > 0, got {budget!r}")
        if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                                    or not seconds >= 0):
            raise ValueError(f"seconds must be None or a number >= 0, got {seconds!r}")
        if self._done:
            return True
        if self._closing:
            raise RuntimeError("step() on a closed SlicedCall")
        self._budget, self._spent = float(budget), 0.0
        self._deadline = None if seconds is None else time.perf_counter() + seconds
        self.steps += 1
        if self._thread.ident is None:
            self._thread.start()
        else:
            self._resume.release()
        self._paused.acquire()
        return self._done

    def result(self) -> Any:
        """``fn()``'s return value once :attr:`done`; re-raises what it raised."""
        if not self._done:
            raise RuntimeError("result() before the sliced call ended")
        if self._error is not None:
            raise self._error
        return self._result

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop a paused call: it raises :class:`Interrupted` at its pause point and its thread ends."""
        if self._done or self._closing:
            return
        self._closing = True
        if self._thread.ident is not None:  # paused at a pause point: wake it to unwind
            self._resume.release()
            self._paused.acquire(timeout=timeout)
            self._thread.join(timeout)
        else:
            self._done = True

    # ------------------------------------------------------------------ the call's thread
    def _main(self) -> None:
        try:
            if self._setup is not None:
                self._setup()
            _LOCAL.hook = self._on_layer
            self._result = self._fn()
        except Interrupted:
            pass
        except BaseException as exc:  # handed to the owner by result()
            self._error = exc
        finally:
            _LOCAL.hook = None
            self._done = True
            self._paused.release()

    def _on_layer(self, work: float) -> None:
        self._spent += work
        if self._spent < self._budget and (self._deadline is None or time.perf_counter() < self._deadline):
            return
        self._paused.release()  # the owner goes on (a decode step, ...) while this thread waits
        self._resume.acquire()
        if self._closing:
            raise Interrupted
