"""``Work``: the handle an ``async_op=True`` collective or an isend/irecv returns."""

from __future__ import annotations

import datetime
import queue
import threading
from typing import Any, Callable

import torch

from tandem._words import secs
from tandem.config import timeout_seconds
from tandem.errors import CollectiveTimeoutError

__all__ = ["Work", "Completions"]


class Completions:
    """A daemon thread per process group that resolves futures, so callbacks may block.

    A callback runs in the thread that resolves its future. Resolving on the group's
    progress engine or a transport reader would deadlock a callback that issues a
    blocking collective (it would wait for the very thread running it); here it only
    delays later callbacks.
    """

    def __init__(self) -> None:
        # unbounded by design: one entry per completed op, and ops are bounded by the
        # caller's own outstanding Work objects
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if self._closed:
                fn()  # the group is gone: resolve here rather than never
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True,
                                                name="tandem-futures")
                self._thread.start()
        self._queue.put(fn)

    def _loop(self) -> None:
        while True:
            fn = self._queue.get()
            if fn is None:
                return
            fn()

    def close(self, timeout: float = 1.0) -> None:
        """Run what is queued, then end the thread (waiting up to ``timeout`` seconds)."""
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is None:
            return
        self._queue.put(None)
        if thread is not threading.current_thread():
            thread.join(timeout)


class Work:
    """Completion handle. ``wait()`` blocks and re-raises the operation's error."""

    def __init__(self, describe: str, result: Any = None,
                 completions: Completions | None = None) -> None:
        self._describe = describe
        self._completions = completions
        self._event = threading.Event()
        self._error: BaseException | None = None
        self._result = result
        self._future: torch.futures.Future | None = None
        self._lock = threading.Lock()
        self._done = False
        self._source: int = -1
        self._waiter: Callable[[float | None], None] | None = None

    # -- completion (called by the progress engine) ----------------------------------
    def _complete(self, result: Any = None, error: BaseException | None = None) -> None:
        with self._lock:
            if self._done:
                return
            if result is not None:
                self._result = result
            self._error = error
            self._done = True
            future = self._future
        if future is None or self._completions is None:
            if future is not None:
                self._resolve(future)
            self._event.set()
            return

        def resolve() -> None:
            self._resolve(future)  # before waking waiters: wait() implies the future is done
            self._event.set()

        self._completions.submit(resolve)

    def _resolve(self, future: torch.futures.Future) -> None:
        try:
            if self._error is not None:
                future.set_exception(self._error)
            else:
                future.set_result(self._result)
        except Exception:  # noqa: BLE001 - a raising callback is the future's to report
            pass

    # -- torch-compatible API --------------------------------------------------------
    def wait(self, timeout: float | datetime.timedelta | None = None) -> bool:
        seconds = None if timeout is None else timeout_seconds(timeout, 0.0, "Work.wait: timeout")
        if self._waiter is not None and not self._event.is_set():
            self._waiter(seconds)  # drives the operation from this thread (p2p)
        if not self._event.wait(seconds):
            assert seconds is not None  # a wait without a timeout returns only once set
            raise CollectiveTimeoutError(f"{self._describe} did not complete within "
                                         f"{secs(seconds)}s")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._event.is_set()

    def is_success(self) -> bool:
        return self._event.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> Any:
        self.wait()
        return self._result

    def source_rank(self) -> int:
        """For a receive from any source: the group rank that sent the message."""
        self.wait()
        return self._source

    def get_future(self) -> torch.futures.Future:
        """A ``torch.futures.Future`` completed with the op's result tensors."""
        with self._lock:
            if self._future is None:
                self._future = torch.futures.Future()
                if self._done:
                    self._resolve(self._future)
            return self._future

    def __repr__(self) -> str:
        state = "done" if self._event.is_set() else "pending"
        return f"<Work {self._describe} {state}>"
