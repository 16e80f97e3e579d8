"""How a worker's uncaught exception reaches the console: once, and readable.

The worker bootstrap (``_worker.py``) hands every uncaught exception to :func:`report`,
which returns the text to print on the worker's stderr:

* the first rank of an attempt (on its node) to fail with an error of its own prints
  its traceback, with each run of tandem's own frames folded into one line::

      Traceback (most recent call last):
        File "train.py", line 9, in <module>
          dist.all_reduce(t)
        ... 8 frames inside tandem (TANDEM_DEBUG=1 shows them)
      tandem.errors.CollectiveMismatchError: collective mismatch (group 0, ...): ...

  A chained exception raised entirely inside tandem (the lower-layer error that
  tandem translated) is left out: the message of the error it became says it.
* every other failing rank prints one line, where in the user's code it failed::

      tandem.errors.CollectiveMismatchError at train.py:7 in <module>: collective mismatch ...

  So does a rank whose error is only the consequence of another rank's death
  (``PeerLostError``), even if it fails first: it is not the cause.
* ``KeyboardInterrupt`` (Ctrl-C, which the launcher passes to every rank) prints one
  line: where the rank was, ``KeyboardInterrupt at trainer.py:208 in train``.
* with ``TANDEM_DEBUG=1`` every rank prints its whole traceback, tandem's frames included.

"First" is decided by a claim file (``TANDEM_TRACEBACK_ONCE``, one per attempt and
node, created with ``O_EXCL``): whoever creates it prints the traceback. Without the
variable (the bootstrap run by hand) every rank prints its traceback, folded.

Standard library only: the bootstrap loads this file by path, on a failure only, so that
a worker never imports tandem (and torch) unless its script does.
"""

from __future__ import annotations

import os
import re
import runpy
import sys
import sysconfig
import time
import traceback
from types import TracebackType
from typing import Mapping

__all__ = ["report", "add_hint", "type_name", "user_traceback", "debugging", "CONSEQUENCES"]

# errors a rank raises because another rank failed first (tandem.run.rootcause agrees)
CONSEQUENCES = ("PeerLostError",)
_TANDEM = os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + os.sep
_BOOTSTRAP = os.path.join(_TANDEM, "run", "_worker.py")
_LIBRARIES = tuple({p + os.sep for key in ("stdlib", "platstdlib", "purelib", "platlib")
                    if (p := sysconfig.get_paths().get(key))})


def debugging(env: Mapping[str, str]) -> bool:
    """``TANDEM_DEBUG`` as ``tandem.config`` reads it (1/true/yes/on)."""
    return env.get("TANDEM_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")


def type_name(exc: BaseException) -> str:
    cls = type(exc)
    name = cls.__qualname__
    return name if cls.__module__ == "builtins" else f"{cls.__module__}.{name}"


def user_traceback(exc: BaseException) -> TracebackType | None:
    """Skip the frames of the bootstrap and of runpy, so tracebacks start in the script."""
    tb = exc.__traceback__
    skip = {_BOOTSTRAP, os.path.realpath(runpy.__file__ or ""), "<frozen runpy>"}
    while tb is not None and (tb.tb_frame.f_code.co_filename in skip
                              or os.path.realpath(tb.tb_frame.f_code.co_filename) in skip):
        tb = tb.tb_next
    return tb


def _inside_tandem(frame: traceback.FrameSummary) -> bool:
    return os.path.realpath(frame.filename).startswith(_TANDEM)


def _in_a_library(frame: traceback.FrameSummary) -> bool:
    """Tandem, the standard library or an installed package: not the user's code."""
    path = os.path.realpath(frame.filename)
    return (path.startswith(_TANDEM) or path.startswith(_LIBRARIES)
            or frame.filename.startswith("<"))


class _Folded(traceback.StackSummary):
    """A stack that prints each run of tandem's frames as one line."""

    def format(self) -> list[str]:
        out: list[str] = []
        hidden = 0
        for frame in self:
            if _inside_tandem(frame):
                hidden += 1
                continue
            if hidden:
                out.append(_fold_line(hidden))
                hidden = 0
            out += traceback.StackSummary.from_list([frame]).format()
        if hidden:
            out.append(_fold_line(hidden))
        return out


def _fold_line(n: int) -> str:
    return f"  ... {n} frame{'s' if n > 1 else ''} inside tandem (TANDEM_DEBUG=1 shows them)\n"


def _fold(te: traceback.TracebackException) -> None:
    """Fold ``te``'s frames and those of its chain; drop links raised wholly inside tandem."""
    seen: set[int] = set()
    link: traceback.TracebackException | None = te
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        folded = _Folded()
        folded.extend(link.stack)
        link.stack = folded
        for attr in ("__cause__", "__context__"):
            inner = getattr(link, attr)
            if inner is not None and all(_inside_tandem(f) for f in inner.stack):
                setattr(link, attr, None)
        link = link.__cause__ or (None if link.__suppress_context__ else link.__context__)


# torch's message when one of its own torch.distributed functions finds no default group
_NO_TORCH_GROUP = "Default process group has not been initialized"
# where a half-ported script most often still calls torch's code, and its tandem twin
_TWINS = {os.path.join("torch", "utils", "data", "distributed.py"):
          "use tandem.parallel.DistributedSampler instead of torch.utils.data's"}


def _refused_import(exc: ImportError) -> str | None:
    """The message of the refusal behind ``from tandem.M import X`` (Python replaces the
    module's AttributeError, which says what to use instead, by a bare ImportError)."""
    name = exc.name or ""
    if isinstance(exc, ModuleNotFoundError):  # tandem.a.b missing: ask tandem.a for b
        name, _, attr = name.rpartition(".")
    else:
        found = re.match(r"cannot import name '([^']+)'", str(exc))
        attr = found.group(1) if found else ""
    module = sys.modules.get(name)
    if not attr or module is None or not (name == "tandem" or name.startswith("tandem.")):
        return None
    try:
        getattr(module, attr)
    except AttributeError as refused:
        if any(cls.__name__ == "TandemError" for cls in type(refused).__mro__):
            return str(refused)
    except Exception:  # noqa: BLE001 - a hint must never hide the error itself
        return None
    return None


def add_hint(exc: BaseException) -> None:
    """Add a note to an error whose message misleads a porting user: torch's 'no default
    process group' when this process did initialise tandem's group (the script still
    calls torch.distributed's own code somewhere: the note names the call and its twin),
    and an import of a name tandem refuses (the note is the refusal's message)."""
    add_note = getattr(exc, "add_note", None)  # Python 3.11+
    if add_note is None:
        return
    if isinstance(exc, ImportError):
        refused = _refused_import(exc)
        if refused is not None:
            add_note(refused)
        return
    if not isinstance(exc, (ValueError, RuntimeError)) or _NO_TORCH_GROUP not in str(exc):
        return
    world = sys.modules.get("tandem.collectives.world")
    try:
        initialised = world is not None and world.is_initialized()
    except Exception:  # noqa: BLE001 - a hint must never hide the error itself
        return
    if not initialised:
        return
    frames = traceback.extract_tb(exc.__traceback__)
    torch_frames = [f for f in frames if os.sep + "torch" + os.sep in f.filename]
    if not torch_frames:
        return
    entry = torch_frames[0]  # where the script (or its library) entered torch
    twin = next((t for path, t in _TWINS.items() if entry.filename.endswith(path)),
                "call its tandem twin instead (torch.distributed.X is tandem.X)")
    add_note(f"tandemrun: tandem's process group is initialised, but this call went "
                 f"into torch's own code ({entry.filename}:{entry.lineno}, in {entry.name}), "
                 f"which cannot see it: {twin}")


def full(exc: BaseException, fold: bool = True) -> str:
    """The traceback of ``exc`` from the script's first frame on, tandem's frames folded."""
    te = traceback.TracebackException(type(exc), exc, user_traceback(exc))
    if fold:
        _fold(te)
    return "".join(te.format())


def _where(exc: BaseException) -> str:
    """``file:line in function`` of the innermost frame of the user's own code."""
    frames = traceback.extract_tb(user_traceback(exc))
    if not frames:
        return ""
    mine = [f for f in frames if not _in_a_library(f)]
    frame = (mine or [f for f in frames if not _inside_tandem(f)] or frames)[-1]
    path = os.path.abspath(frame.filename)
    if path.startswith(os.getcwd() + os.sep):
        path = os.path.relpath(path)
    return f"{path}:{frame.lineno} in {frame.name}"


def one_line(exc: BaseException) -> str:
    where = _where(exc)
    text = type_name(exc) + (f" at {where}" if where else "")
    message = (str(exc).splitlines() or [""])[0]
    return f"{text}: {message}\n" if message else text + "\n"


def _claim(path: str) -> bool:
    """Whether this rank is the first to fail (the claim file was ours to create)."""
    if not path:
        return True
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    except OSError:
        return True  # cannot tell: printing twice beats printing nothing
    os.write(fd, os.environ.get("RANK", "").encode())
    os.close(fd)
    return True


def is_consequence(exc: BaseException) -> bool:
    return any(cls.__name__ in CONSEQUENCES and cls.__module__ == "tandem.errors"
               for cls in type(exc).__mro__)


def report(exc: BaseException) -> tuple[str, bool, float]:
    """What this rank prints for ``exc``, whether that is its whole traceback, and the
    time to record: the rank that printed its traceback has the earliest of all (its
    time is taken before its claim, the others' after theirs failed), so the
    launcher's root cause is the rank whose traceback is on the console."""
    when = time.time()
    if debugging(os.environ):
        return full(exc, fold=False), True, when
    if isinstance(exc, KeyboardInterrupt) or is_consequence(exc):
        return one_line(exc), False, when
    if not _claim(os.environ.get("TANDEM_TRACEBACK_ONCE", "")):
        return one_line(exc), False, time.time()
    return full(exc), True, when
