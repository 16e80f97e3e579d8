"""``run_elastic``: run a training function so that it survives the loss of a rank.

::

    @run_elastic(state)
    def train(state):
        for x, y in loader:                  # an ElasticSampler follows the membership
            ...
            state.step += 1
            state.commit()                   # every N steps
        return state.step

    train()                                  # on every rank, like any training loop

The function is called with the state (and any arguments given to the wrapper). When
a collective fails because a peer died, every survivor leaves the function, rolls back
to the last commit, forms a new process group without the dead rank (ranks renumbered
densely, DDP re-bound) and calls the function again; nobody restarts. When a commit
sees workers waiting to join and the job has room, every member stops there, the
group grows, and the joiners receive the state from a live member. Errors that are not
a lost peer (a bug, a mismatch) propagate as usual.

A worker started to join (``TANDEM_ELASTIC_JOIN=1``, set by tandemrun for replacements
and spares) runs the script's code before ``run_elastic`` alone, in a process group of
its own; inside, it waits to be admitted. If the job finishes first it exits with
status 0 without running the rest of the script.
"""

from __future__ import annotations

import functools
import textwrap
from typing import Any, Callable, Concatenate, ParamSpec, TypeVar

from tandem._words import counted
from tandem.elastic._session import Finished, Regroup, Session, note
from tandem.elastic._state import ElasticState
from tandem.errors import ArgumentError

__all__ = ["run_elastic"]

P = ParamSpec("P")
R = TypeVar("R")


def run_elastic(state: ElasticState) -> Callable[[Callable[Concatenate[ElasticState, P], R]],
                                                 Callable[P, R]]:
    """Decorate a training function ``fn(state, ...)``; see the module docstring."""
    if not isinstance(state, ElasticState):
        raise ArgumentError(f"run_elastic takes an ElasticState, got {type(state).__name__}")

    def decorate(fn: Callable[Concatenate[ElasticState, P], R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def run(*args: P.args, **kwargs: P.kwargs) -> R:
            session = state._open_session(Session)
            try:
                session.start()
                if session.joining:
                    note(f"worker {session.me} admitted: generation {session.number}, rank "
                         f"{state.rank} of {state.world_size}, {_where(state)} received from "
                         f"a live rank")
                return _loop(session, fn, state, args, kwargs)
            except Finished:
                note(f"the job finished before worker {session.me} was admitted; it leaves")
                raise SystemExit(0) from None
            finally:
                state._close_session()
                session.close()

        return run

    return decorate


def _loop(session: Session, fn: Callable[..., R], state: ElasticState, args: tuple[Any, ...],
          kwargs: dict[str, Any]) -> R:
    while True:
        try:
            result = fn(state, *args, **kwargs)
            session.finish()
            return result
        except Regroup:
            session.grow()
            if state.rank == 0:
                note(f"generation {session.number}: {counted(state.world_size, 'rank')}, joiners let in "
                     f"at {_where(state)}")
        except Exception as exc:  # noqa: BLE001 - a lost peer is recovered, the rest re-raised
            if not session.recoverable(exc):
                raise
            note(f"{_brief(exc)}; going on without the lost rank(s)")
            session.recover(exc)
            note(f"generation {session.number}: rank {state.rank} of {state.world_size}, rolled "
                 f"back to {_where(state)}")


def _where(state: ElasticState) -> str:
    """The commit the state holds, in words (with its step, if the state has one)."""
    return f"commit {state._commits}" + (f" (step {state.step})" if "step" in state._values
                                         else "")


def _brief(exc: BaseException) -> str:
    """The error's type and first line, shortened at a word, never inside one."""
    first = (str(exc).splitlines() or [""])[0]
    return f"{type(exc).__name__}: {textwrap.shorten(first, 200, placeholder=' ...')}"
