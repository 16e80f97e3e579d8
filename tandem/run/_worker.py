"""Worker bootstrap: every worker the launcher starts runs through this file.

::

    python tandem/run/_worker.py --parent PID script.py ARGS...     # like python script.py
    python tandem/run/_worker.py --parent PID -m pkg.mod ARGS...    # like python -m pkg.mod
    python tandem/run/_worker.py --parent PID --exec prog ARGS...   # --no-python: exec prog

It ties the worker's life to the launcher (``PR_SET_PDEATHSIG`` on Linux, which
survives exec, plus a thread that watches the parent pid everywhere), and records
an uncaught exception without any decorator: rank, host, time, exception type,
message and traceback go as JSON to ``$TANDEM_ERROR_FILE`` before the worker exits 1.
It is run by path, not with ``-m``, so that a worker does not import tandem (and torch)
unless its script does; it therefore imports the standard library only.
"""

import os  # already imported by the interpreter's startup, so never shadowed
import sys

if sys.path and sys.path[0] and (
        os.path.realpath(sys.path[0]) == os.path.dirname(os.path.realpath(__file__))):
    sys.path.pop(0)  # our directory must not shadow the script's imports

import ctypes  # noqa: E402 - after the path fix above
import json  # noqa: E402
import runpy  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from types import TracebackType  # noqa: E402
from typing import List, Optional  # noqa: E402

PR_SET_PDEATHSIG = 1
WATCH_INTERVAL = 0.5


def _die_with_parent(parent: int) -> None:
    """SIGKILL this worker (and its process group) when the launcher goes away."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the watcher thread below still covers it
    if parent and os.getppid() != parent:
        os._exit(1)  # the launcher died before we could ask to follow it

    def watch() -> None:
        while True:
            time.sleep(WATCH_INTERVAL)
            if os.getppid() != parent:
                if os.getpgrp() == os.getpid():
                    os.killpg(os.getpid(), signal.SIGKILL)  # our children too
                os.kill(os.getpid(), signal.SIGKILL)

    if parent:
        threading.Thread(target=watch, name="tandem-parent-watch", daemon=True).start()


def _user_traceback(exc: BaseException) -> Optional[TracebackType]:
    """Skip the frames of this bootstrap and of runpy, so tracebacks start in the script."""
    tb = exc.__traceback__
    skip = {os.path.abspath(__file__), os.path.abspath(runpy.__file__ or ""), "<frozen runpy>"}
    while tb is not None and (tb.tb_frame.f_code.co_filename in skip
                              or os.path.abspath(tb.tb_frame.f_code.co_filename) in skip):
        tb = tb.tb_next
    return tb


def _type_name(exc: BaseException) -> str:
    cls = type(exc)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def record_error(exc: BaseException, path: str) -> None:
    """Write the JSON error record for ``exc`` to ``path`` unless one is already there."""
    if not path or os.path.exists(path):
        return  # the script recorded its own error
    text = "".join(traceback.format_exception(type(exc), exc, _user_traceback(exc)))
    record = {
        "rank": int(os.environ.get("RANK", "-1")),
        "local_rank": int(os.environ.get("LOCAL_RANK", "-1")),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "time": time.time(),
        "exc_type": _type_name(exc),
        "message": str(exc),
        "traceback": text,
    }
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(record, f)
        os.replace(tmp, path)
    except OSError as err:
        sys.stderr.write(f"tandemrun worker: cannot write error file {path}: {err}\n")


def _run(mode: str, target: str, args: List[str]) -> None:
    if mode == "exec":
        os.execvp(target, [target, *args])
    sys.argv = [target, *args]
    if mode == "module":
        sys.path.insert(0, os.getcwd())
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        runpy.run_path(target, run_name="__main__")


def main(argv: List[str]) -> None:
    parent, mode = 0, "script"
    while argv and argv[0] in ("--parent", "-m", "--exec", "--"):
        flag = argv.pop(0)
        if flag == "--parent":
            parent = int(argv.pop(0))
        elif flag == "-m":
            mode = "module"
        elif flag == "--exec":
            mode = "exec"
        else:
            break
    if not argv:
        sys.exit("usage: _worker.py --parent PID [-m | --exec] TARGET [ARGS...]")
    _die_with_parent(parent)
    if hasattr(sys.stdout, "reconfigure") and not sys.stdout.isatty():
        sys.stdout.reconfigure(line_buffering=True)  # lines reach the console as printed
    try:
        _run(mode, argv[0], argv[1:])
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:  # noqa: BLE001 - recorded, printed, then exit 1
        record_error(exc, os.environ.get("TANDEM_ERROR_FILE", ""))
        traceback.print_exception(type(exc), exc, _user_traceback(exc))
        sys.stderr.flush()
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
