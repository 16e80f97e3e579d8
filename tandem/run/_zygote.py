"""The zygote: a process that has imported torch and tandem, and forks warm workers.

::

    python tandem/run/_zygote.py --parent PID --socket FD

The launcher's agent starts one per node when a job runs elastic (:mod:`tandem.run.warm`
is its side). It imports what every worker's script imports first (``WARM_MODULES``),
then waits on ``FD``, a ``SOCK_SEQPACKET`` socket to the agent. Each request is a JSON
message (the worker's bootstrap arguments, environment and working directory) with
three file descriptors (its stdout, its stderr, and the pipe on which its supervisor
reports the worker's pid). For each, the zygote forks twice: the middle process exits
at once, so the new process is adopted by the agent (a child subreaper) and is the
agent's child like any worker it starts itself: the agent waits for it, kills it and
reads its exit status as usual. The new process starts a session of its own, takes the
descriptors as its stdio and the environment as its own, and goes on exactly as
``_worker.py`` does (its supervisor, then the worker running the script as
``__main__``), on an interpreter that has torch imported already. (It keeps the
zygote's command line: ``ps`` shows warm workers and their supervisors as
``_zygote.py``.)

Fork safety. The zygote never runs a torch operation (torch's thread pools start on
the first one), opens no transport and no store connection, and checks that it has one
thread (Python's and the kernel's count) before it says it is ready: a process with
other threads cannot be forked safely (a lock held by one of them stays held forever
in the child), so such a zygote reports an error instead and the agent starts workers
the usual way. It imports the standard library only until its warm-up.

Messages to the agent, one JSON object each: ``{"ready": pid}`` once warm, then
``{"pid": N}`` per request; ``{"error": text}`` when it cannot (it then exits). The
zygote ends when the agent closes the socket or dies (a parent-death signal).
"""

import os  # already imported by the interpreter's startup, so never shadowed
import sys

_HERE = os.path.dirname(os.path.realpath(__file__))
if sys.path and sys.path[0] and os.path.realpath(sys.path[0]) == _HERE:
    sys.path.pop(0)  # as _worker.py: our directory must not shadow the script's imports

import gc  # noqa: E402 - after the path fix above
import importlib  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from types import ModuleType  # noqa: E402
from typing import Any, Callable, Dict, List, Tuple  # noqa: E402

# What training scripts import first; each import must start no thread (see warm_up).
# torch._dynamo is what torch's optimizers import when the first one is made: 800 modules,
# 1-2.5 s of a new worker's start on a loaded 2-core host, more than anything it runs
# itself before it joins (the main example, measured).
WARM_MODULES = ("torch", "torch._dynamo", "torch.nn.functional", "torch.utils.data",
                "tandem", "tandem.collectives.api", "tandem.collectives.barriers",
                "tandem.parallel", "tandem.elastic", "tandem.optim", "tandem.checkpoint")
MAX_SAID = 8192  # bytes of what the imports printed that the agent shows (the end of it)
MAX_REQUEST = 1 << 20  # bytes: the environment of a worker, with room to spare
ADOPTION_WAIT = 5.0  # seconds for the agent to adopt a new process (it takes microseconds)


def threads() -> List[str]:
    """The names of this process's threads, as the kernel counts them."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return ["?"] * threading.active_count()
    names = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            names.append("?")
    return names


def warm_up() -> str:
    """Import ``WARM_MODULES``; why this process cannot fork warm workers ("" if it can)."""
    try:
        for name in WARM_MODULES:
            importlib.import_module(name)
    except BaseException as exc:  # noqa: BLE001 - reported to the agent, which starts cold
        return f"importing {name} failed: {type(exc).__name__}: {exc}"
    bind_exports()
    names = threads()
    if len(names) != 1 or threading.active_count() != 1:
        return (f"it has {len(names)} threads after importing torch ({', '.join(names)}); "
                f"a process with threads cannot fork safely (OMP_NUM_THREADS=1 or "
                f"OPENBLAS_NUM_THREADS=1 keeps numpy's BLAS from starting its pool)")
    return ""


def bind_exports() -> None:
    """Bind, in this process, the names tandem exports lazily (``tandem.__getattr__``)
    whose modules are imported already: each process forked from it would otherwise
    resolve them on first use (``tandem.init_process_group``, ``tandem.barrier``: ~50
    copy-on-write page faults a rank), in pages it shares with this one. No import."""
    tandem = sys.modules.get("tandem")
    exports = getattr(tandem, "_EXPORTS", None)
    if not isinstance(exports, dict):
        return
    for name, module in exports.items():
        if module in sys.modules:
            try:
                getattr(tandem, name)
            except AttributeError:  # a name its module lacks: resolved (and refused) later
                pass


def quietly(fn: Callable[[], str]) -> Tuple[str, str]:
    """``fn()`` with this process's stderr (descriptor 2) caught: its result, and the end
    of what it printed (import warnings, which a worker started cold would print itself)."""
    import tempfile  # only here: the zygote imports no more than it needs before its warm-up

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            result = fn()
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        caught.seek(0, os.SEEK_END)
        caught.seek(max(0, caught.tell() - MAX_SAID))
        said = caught.read().decode(errors="replace")
    return result, said


def _send(sock: socket.socket, message: Dict[str, Any]) -> None:
    sock.send(json.dumps(message).encode())


def serve(sock: socket.socket, parent: int) -> Tuple[Dict[str, Any], List[int]]:
    """Answer the agent's requests; returns only in a new worker process, with its request
    and descriptors (the zygote itself exits when the agent is gone)."""
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, MAX_REQUEST, 5)
        except OSError:
            data, fds = b"", []
        if not data:
            os._exit(0)  # the agent closed its end, or died
        try:
            request = json.loads(data)
            wanted = 3 + bool(request.get("guard")) + bool(request.get("gate"))
            if len(fds) != wanted:
                raise ValueError(f"{len(fds)} descriptors, not {wanted}")
            pid = _fork_adopted(sock)
        except Exception as exc:  # noqa: BLE001 - the agent hears of it and starts cold
            _send(sock, {"error": f"{type(exc).__name__}: {exc}"})
            pid = -1
        if pid == 0:
            return request, fds
        for fd in fds:
            os.close(fd)  # the new process has them; the pipes must end with it
        if pid > 0:
            _send(sock, {"pid": pid})


def _fork_adopted(sock: socket.socket) -> int:
    """Fork a process whose parent becomes the agent: its pid here, 0 in it."""
    sys.stdout.flush()
    sys.stderr.flush()
    told, tell = os.pipe()
    middle = os.fork()
    if middle == 0:  # exits at once; its child goes to the nearest subreaper: the agent
        child = -1
        try:
            os.close(told)
            child = os.fork()
            if child == 0:
                os.close(tell)
                sock.close()
                return 0
            os.write(tell, str(child).encode())
        finally:
            if child != 0:
                os._exit(0)
    os.close(tell)
    with os.fdopen(told, "rb") as f:
        text = f.read(32)
    os.waitpid(middle, 0)  # once it is reaped, its child has been adopted
    if not text.isdigit():
        raise OSError("the middle process could not fork")
    return int(text)


def become(request: Dict[str, Any], fds: List[int], parent: int) -> List[str]:
    """Turn this new process into what ``_worker.py`` starts as; its bootstrap arguments."""
    out, err, report = fds[:3]
    guard = fds[3:4] if request.get("guard") else []  # the job reaper's pipe, if any
    gate = fds[-1] if request.get("gate") else -1
    os.setsid()  # a session and process group of its own, as any worker's supervisor
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.close(out)
    os.close(err)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # random generators seeded once, in the zygote, must not be shared by the workers: a new
    # interpreter seeds torch's default generator afresh, as it does numpy's global one
    # (Python's random module reseeds itself after a fork)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.seed()
    numpy = sys.modules.get("numpy.random")
    if numpy is not None:
        numpy.seed()
    deadline = time.monotonic() + ADOPTION_WAIT
    while os.getppid() != parent and time.monotonic() < deadline:
        time.sleep(0.0005)  # the middle process is exiting
    if gate >= 0:  # the agent's first workers start together, as new interpreters would
        while True:
            try:
                if not os.read(gate, 64):
                    break  # every one is forked (or the agent is gone)
            except InterruptedError:
                continue
        os.close(gate)
    return ["--report", str(report), *(["--guard", str(guard[0])] if guard else []),
            *(str(a) for a in request["argv"])]


def _load_worker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("tandem.run._worker",
                                                  os.path.join(_HERE, "_worker.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: List[str]) -> None:
    options = dict(zip(argv[::2], argv[1::2]))
    parent, fd = int(options.get("--parent", "0")), int(options.get("--socket", "-1"))
    sock = socket.socket(fileno=fd)
    worker = _load_worker()  # the bootstrap each new process goes on with; stdlib only
    if not worker._prctl(worker.PR_SET_PDEATHSIG, signal.SIGKILL) or os.getppid() != parent:
        _send(sock, {"error": "it cannot follow the agent's death (PR_SET_PDEATHSIG)"})
        os._exit(1)
    why, said = quietly(warm_up)
    if why:
        _send(sock, {"error": why + (f"; it printed: {said[-2000:]}" if said.strip() else "")})
        os._exit(1)
    # what the imports made lives as long as the workers: kept out of their collections,
    # whose marks would copy the pages the workers now share with the zygote
    gc.collect()
    gc.freeze()
    _send(sock, {"ready": os.getpid(), "said": said})
    request, fds = serve(sock, parent)
    worker.main(become(request, fds, parent))  # as `python _worker.py ARGS`: exits as it does


if __name__ == "__main__":
    main(sys.argv[1:])
