"""The one exception tree of tandem.

Every error tandem raises on purpose is a :class:`TandemError`. Lower-layer
errors (``OSError``, ``socket.timeout``, ...) are translated where they cross a
layer boundary with ``raise ... from exc`` so the original stays visible in the
traceback::

    TandemError
    ├── ArgumentError        (also a ValueError) bad input: wrong rank, dtype, shape, op...
    ├── StateError           (also a RuntimeError) misuse: no default group, rank outside group,
    │   │                    a process group that was destroyed or aborted
    │   └── ElasticError            an elastic job (``tandem.elastic``) cannot go on: fewer
    │                               ranks or nodes than its minimum, no live rank holds the
    │                               training state, or this worker was left out of the job
    ├── TimeoutError         (also the builtin TimeoutError) a deadline passed
    │   ├── StoreTimeoutError       store get/wait/connect ran out of time
    │   └── CollectiveTimeoutError  a collective or p2p op ran out of time;
    │                               ``.missing`` names the ranks not heard from
    ├── StoreError           the key-value store failed (server gone, protocol error)
    ├── NetworkError         a connection could not be made or broke
    │   ├── AuthenticationError     a peer failed the HMAC challenge (wrong secret, stranger)
    │   ├── ProtocolError           malformed or over-sized frame
    │   └── PeerLostError           a peer rank died or closed its connection; ``.rank`` names it
    ├── CollectiveMismatchError     ranks called different collectives (op, sequence number,
    │                               dtype, shape, reduce op or root); the message names the
    │                               ranks, both signatures and both callers' file:line
    ├── WorkerFailedError    (also a RuntimeError) a rank of a job that tandem started (Ray
    │                        actors: ``tandem.ray``) died or raised; ``.rank``, ``.node`` and
    │                        ``.cause`` name the first one, the message every rank's end
    └── RpcError             (also a RuntimeError) a remote call failed; a remote exception
        │                    whose own class cannot be rebuilt arrives as this, with the
        │                    worker's name and the remote traceback in its message
        └── RpcTimeoutError         (also a TimeoutError) a call did not complete in time;
                                    the message names the function, the worker and the time

A :class:`CollectiveError` base groups the errors raised by collective and p2p
calls (timeouts are reported through ``CollectiveTimeoutError``).

torch's names for these failures are here too, so that a ported ``except`` clause
catches what it caught under torch: ``DistError`` (a ``RuntimeError``) and below it
``DistBackendError`` (every ``CollectiveError``), ``DistNetworkError`` (every
``NetworkError``), ``DistStoreError`` (every ``StoreError`` and ``StoreTimeoutError``)
and ``QueueEmptyError`` (tandem's stores have no queues: nothing raises it). tandem's
classes derive from them, so one tree serves both sets of names.
"""

from __future__ import annotations

import builtins

__all__ = [
    "TandemError",
    "ArgumentError",
    "StateError",
    "ElasticError",
    "TimeoutError",
    "StoreTimeoutError",
    "CollectiveTimeoutError",
    "StoreError",
    "NetworkError",
    "AuthenticationError",
    "ProtocolError",
    "PeerLostError",
    "CollectiveError",
    "CollectiveMismatchError",
    "RpcError",
    "RpcTimeoutError",
    "WorkerFailedError",
    "DistError",
    "DistBackendError",
    "DistNetworkError",
    "DistStoreError",
    "QueueEmptyError",
]


class DistError(RuntimeError):
    """torch's base of distributed failures (see the module docstring)."""


class DistBackendError(DistError):
    """torch's name for a failed collective or p2p call: every :class:`CollectiveError`."""


class DistNetworkError(DistError):
    """torch's name for a failed connection: every :class:`NetworkError`."""


class DistStoreError(DistError):
    """torch's name for a failed store call: every :class:`StoreError` and
    :class:`StoreTimeoutError`."""


class QueueEmptyError(DistStoreError):
    """torch's error for reading an empty store queue (tandem's stores have none)."""


class TandemError(Exception):
    """Base class of every error tandem raises on purpose."""


class ArgumentError(TandemError, ValueError):
    """An argument is invalid: the message names the argument and what was wrong."""


class StateError(TandemError, RuntimeError):
    """An operation is not allowed in the current state (not initialised, not a member...)."""


class ElasticError(StateError):
    """An elastic job cannot go on in place; the message says why and what the minimum is."""


class TimeoutError(TandemError, builtins.TimeoutError):  # noqa: A001 - deliberate shadow
    """A deadline passed."""


class StoreTimeoutError(TimeoutError, DistStoreError):
    """A store operation (connect, get, wait) did not finish before its deadline."""


class CollectiveError(TandemError, DistBackendError):
    """Base class of errors raised by collective and point-to-point operations."""


class CollectiveTimeoutError(TimeoutError, CollectiveError):
    """A collective or p2p op did not finish in time.

    ``missing`` lists the global ranks from which an expected message never came.
    """

    def __init__(self, message: str, missing: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.missing = missing


class StoreError(TandemError, DistStoreError):
    """The key-value store failed."""


class NetworkError(TandemError, DistNetworkError, ConnectionError):
    """A connection could not be established or broke."""


class AuthenticationError(NetworkError):
    """A peer did not prove knowledge of the job secret."""


class ProtocolError(NetworkError):
    """A frame was malformed, too large or unexpected."""


class PeerLostError(NetworkError, CollectiveError):
    """A peer rank died or closed its connection.

    ``rank`` is the global rank that was lost.
    """

    def __init__(self, message: str, rank: int = -1) -> None:
        super().__init__(message)
        self.rank = rank


class CollectiveMismatchError(CollectiveError):
    """Ranks issued different collectives; nothing was combined."""


class WorkerFailedError(TandemError, RuntimeError):
    """A rank of a job that tandem started died or raised (the first to fail is named).

    ``rank``, ``node`` (its address) and ``cause`` (how it ended) describe that rank.
    """

    def __init__(self, message: str, rank: int = -1, node: str = "", cause: str = "") -> None:
        super().__init__(message)
        self.rank, self.node, self.cause = rank, node, cause


class RpcError(TandemError, RuntimeError):
    """A remote call failed (also raised for remote exceptions of classes that cannot be
    rebuilt in the caller)."""


class RpcTimeoutError(TimeoutError, RpcError):
    """A remote call did not complete before its deadline."""

