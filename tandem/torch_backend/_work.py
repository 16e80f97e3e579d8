"""``TorchWork``: torch's ``Work`` handle over tandem's.

A torch call may map to several tandem calls (a coalesced call, a list of groups of
one dtype); tandem runs the calls of one group in issue order and aborts the group
on any failure, so waiting on each in turn is waiting on all of them. A call that ran
to completion before returning (``asyncOp=False``) gets a handle with nothing left to
wait for.

torch's C++ code (DDP's reducer, functional collectives) calls ``wait`` and
``get_future`` through pybind11; both re-raise tandem's failures as
:class:`~tandem.torch_backend._errors.TandemBackendError`.
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from tandem.collectives.work import Work
from tandem.torch_backend._errors import translate

__all__ = ["TorchWork", "seconds_or_none", "NO_TIMEOUT"]

# torch's "no timeout" values (kNoTimeout, kUnsetTimeout) are zero and negative: a
# timedelta option above this one is a timeout (compared without converting it)
NO_TIMEOUT = datetime.timedelta(0)


def seconds_or_none(timeout: datetime.timedelta | float | None) -> float | None:
    """torch's "no timeout" is None, zero or negative (``kNoTimeout``, ``kUnsetTimeout``)."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    return float(seconds) if seconds > 0 else None


class TorchWork(dist.Work):
    """The handle a tandem process group returns to torch for one call."""

    def __init__(self, works: Sequence[Work], result: Any,
                 to_global: Callable[[int], int] = lambda r: r,
                 deadline: float | None = None,
                 expire: Callable[[], BaseException] | None = None,
                 after: Callable[[], None] | None = None) -> None:
        """``deadline`` (monotonic) is the call's own timeout; once it passes, a waiter
        calls ``expire``, which aborts the group and returns the error to raise.
        ``after`` runs once when the calls succeeded, before anyone sees the result
        (it copies a packed result into the caller's tensors)."""
        super().__init__()
        self._works = list(works)
        self._result = result
        self._to_global = to_global
        self._deadline = deadline
        self._expire = expire
        self._future: torch.futures.Future | None = None
        self._after = after
        self._after_lock = threading.Lock()

    def _raise(self, exc: BaseException) -> None:
        error = translate(exc, self._to_global)
        if error is exc:
            raise exc
        raise error from exc

    def wait(self, timeout: datetime.timedelta | float | None = None) -> bool:
        """Block until the call finished; raise its error. ``timeout`` bounds this wait."""
        seconds = seconds_or_none(timeout)
        limits = [t for t in (self._deadline, None if seconds is None
                              else time.monotonic() + seconds) if t is not None]
        for work in self._works:
            left = max(min(limits) - time.monotonic(), 0.0) if limits else None
            try:
                work.wait(left)
            except Exception as exc:  # noqa: BLE001 - translated for torch's callers
                if (not work.is_completed() and self._expire is not None
                        and self._deadline is not None and time.monotonic() >= self._deadline):
                    self._raise(self._expire())  # the call's own timeout passed
                self._raise(exc)
        self._finish()
        return True

    def _finish(self) -> None:
        """Run ``after`` once, in whichever thread first sees the calls succeed."""
        if self._after is not None:
            with self._after_lock:
                after, self._after = self._after, None
                if after is not None:
                    after()

    def get_future(self) -> torch.futures.Future:
        """A future completed with the output tensors, or with the call's error."""
        if self._future is None:
            if not self._works:
                self._future = torch.futures.Future()
                self._future.set_result(self._result)
            else:
                futures = [w.get_future() for w in self._works]
                joined = futures[0] if len(futures) == 1 else torch.futures.collect_all(futures)
                self._future = joined.then(self._settle)
        return self._future

    def _settle(self, joined: torch.futures.Future) -> Any:
        try:
            value = joined.value()
            for part in value if isinstance(value, list) and len(self._works) > 1 else []:
                part.value()  # collect_all completes even when a part failed
        except Exception as exc:  # noqa: BLE001 - translated for torch's callers
            self._raise(exc)
        self._finish()
        return self._result

    def is_completed(self) -> bool:
        done = all(w.is_completed() for w in self._works)
        if done and self._after is not None and self.exception() is None:
            self._finish()  # "completed" promises the caller's tensors hold the result
        return done

    def is_success(self) -> bool:
        return self.is_completed() and self.exception() is None

    def exception(self) -> BaseException | None:
        for work in self._works:
            error = work.exception()
            if error is not None:
                return translate(error, self._to_global)
        return None

    def result(self) -> Any:
        self.wait()
        return self._result

    def _source_rank(self) -> int:
        """The group rank that sent a message received from any source."""
        self.wait()
        return self._works[-1].source_rank() if self._works else -1

    def source_rank(self) -> int:
        return self._source_rank()

    def synchronize(self) -> None:
        """Nothing to do: CPU tensors are ready when ``wait`` returns."""

    def __repr__(self) -> str:
        return f"<TorchWork {self._works!r}>"
