"""The launcher's validated settings, built from the command line by :mod:`tandem.run.args`.

Everything the agent needs is in one frozen :class:`LaunchConfig`; tests build one
directly (``LaunchConfig(entrypoint="train.py", nproc_per_node=2)``) without argparse.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import re
import signal
import threading

from tandem._words import counted
from tandem.config import MAX_WORLD_SIZE, at_most
from tandem.errors import ArgumentError

__all__ = ["Std", "StdMap", "LaunchConfig", "parse_nnodes", "parse_nproc", "parse_signals",
           "parse_rdzv_conf", "parse_ranks", "parse_endpoint", "RDZV_CONF_KEYS", "START_METHODS"]


class Std(enum.IntFlag):
    """Which of a worker's streams a ``-r``/``-t`` value names (torchrun's numbering)."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3


@dataclasses.dataclass(frozen=True)
class StdMap:
    """``-r 3`` (every local rank) or ``-r 0:3,1:1`` (per local rank; others NONE)."""

    default: Std = Std.NONE
    per_rank: tuple[tuple[int, Std], ...] = ()

    @classmethod
    def parse(cls, text: str, flag: str) -> StdMap:
        text = (text or "0").strip()
        if re.fullmatch(r"[0-3]", text):
            return cls(Std(int(text)))
        if re.fullmatch(r"(\d+:[0-3])(,\d+:[0-3])*", text):
            pairs = tuple((int(k), Std(int(v))) for k, v in (p.split(":") for p in text.split(",")))
            return cls(Std.NONE, pairs)
        raise ArgumentError(
            f"{flag} {text!r}: expected 0-3 (0 none, 1 stdout, 2 stderr, 3 both) "
            f"or a per-local-rank map like 0:3,1:1")

    def for_rank(self, local_rank: int) -> Std:
        return dict(self.per_rank).get(local_rank, self.default)


WORKER_MEMORY = 64 << 20  # the least any worker needs: a Python process, before torch
MAX_RESTARTS = 10_000
MAX_SECONDS = 86_400.0  # a day: the longest health-check interval or stop grace we take
# shorter polls spin a core of the shared host without reacting any sooner
MIN_MONITOR_INTERVAL = 0.001
# the --rdzv-conf keys tandemrun reads, each with what its value must be
RDZV_CONF_KEYS = {"join_timeout": "seconds > 0", "last_call_timeout": "seconds >= 0",
                  "keep_alive_interval": "seconds >= 0.001",
                  "keep_alive_max_attempt": "an int >= 1"}
START_METHODS = ("spawn", "fork", "forkserver")  # torchrun's choices


def workers_that_fit() -> int | None:
    """How many workers this host's available memory could hold at most (None: unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return max(1, int(line.split()[1]) * 1024 // WORKER_MEMORY)
    except (OSError, ValueError, IndexError):
        pass
    return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """What to launch and how; see ``python -m tandem.run --help`` for each field's flag."""

    entrypoint: str
    args: tuple[str, ...] = ()
    nproc_per_node: int = 1
    min_nodes: int = 1
    max_nodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port (single node) or 29500 (static)
    local_addr: str | None = None
    standalone: bool = False
    rdzv_backend: str = "static"
    rdzv_endpoint: str = ""
    rdzv_id: str = ""
    rdzv_conf: tuple[tuple[str, str], ...] = ()
    max_restarts: int = 0
    spares: int = 0  # elastic jobs: workers per node kept ready to take a lost one's place
    warm_start: bool = True  # workers forked from a zygote per node (tandem.run.warm)
    monitor_interval: float = 0.1
    shutdown_timeout: float = 5.0
    role: str = "default"
    module: bool = False
    no_python: bool = False
    log_dir: str | None = None
    redirects: StdMap = StdMap()
    tee: StdMap = StdMap()
    local_ranks_filter: frozenset[int] | None = None
    signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT,
                                signal.SIGUSR1, signal.SIGUSR2)

    def __post_init__(self) -> None:
        if not self.entrypoint:
            raise ArgumentError("give the training script (or -m module) to launch")
        if self.nproc_per_node < 1:
            raise ArgumentError(f"--nproc-per-node must be >= 1, got {self.nproc_per_node}")
        fit = workers_that_fit()
        if fit is not None and self.nproc_per_node > fit:
            # a typo here (100000 for 10) would otherwise start processes until the host
            # runs out of memory, and take the launcher's signals down with it
            raise ArgumentError(
                f"--nproc-per-node {self.nproc_per_node}: this host's available memory holds "
                f"at most about {counted(fit, 'worker')} (at {WORKER_MEMORY >> 20} MiB each, far less "
                f"than a process that imports torch uses); start fewer workers per node")
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ArgumentError(
                f"--nnodes {self.min_nodes}:{self.max_nodes}: need 1 <= MIN <= MAX")
        if self.max_nodes == 1 and self.node_rank != 0:
            raise ArgumentError(f"--node-rank {self.node_rank} with --nnodes 1; it must be 0")
        if self.rdzv_backend == "static" and not 0 <= self.node_rank < self.max_nodes:
            raise ArgumentError(
                f"--node-rank must be in [0, {self.max_nodes}), got {self.node_rank}")
        if self.rdzv_backend not in ("static", "c10d"):
            raise ArgumentError(
                f"--rdzv-backend {self.rdzv_backend!r}: tandemrun supports static and c10d")
        if self.min_nodes != self.max_nodes and self.rdzv_backend != "c10d":
            raise ArgumentError(f"--nnodes {self.min_nodes}:{self.max_nodes} needs "
                                f"--rdzv-backend c10d (a static rendezvous has a fixed size)")
        if self.master_port is not None and not 0 <= self.master_port <= 65535:
            raise ArgumentError(f"--master-port must be 0..65535, got {self.master_port}")
        if self.max_restarts < 0:
            raise ArgumentError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.spares < 0:
            raise ArgumentError(f"--spares must be >= 0, got {self.spares}")
        if 0 < self.monitor_interval < MIN_MONITOR_INTERVAL:
            # 1e-9 kept a core of the host busy checking on workers, from every launcher
            raise ArgumentError(f"--monitor-interval {self.monitor_interval} is below "
                                f"{MIN_MONITOR_INTERVAL} s: shorter intervals spin a CPU core "
                                f"of this host without reacting sooner; give 0.001 or more "
                                f"(default 0.1)")
        if not (0 < self.monitor_interval < math.inf and 0 <= self.shutdown_timeout < math.inf):
            raise ArgumentError(f"--monitor-interval must be > 0 and --shutdown-timeout >= 0 "
                                f"(finite seconds), got {self.monitor_interval} and "
                                f"{self.shutdown_timeout}")
        self._check_bounds(fit)
        self._check_rendezvous()
        self._check_run_id()

    def _check_run_id(self) -> None:
        """The run id names a directory under --log-dir: ``../x`` wrote logs outside it."""
        rid = self.rdzv_id
        if rid in (".", "..") or "/" in rid or "\0" in rid:
            raise ArgumentError(f"--rdzv-id {rid!r}: the run id names the job's directory "
                                f"under --log-dir, so it may not be '.' or '..' or hold '/' "
                                f"or a NUL; give a plain name such as job7")
        at_most("--rdzv-id length", len(rid.encode(errors="replace")), 200,
                "bytes: it names a directory, and a file name holds at most 255",
                "give a shorter run id")

    def _check_rendezvous(self) -> None:
        """--rdzv-endpoint and every --rdzv-conf entry, whether this launch uses them or
        not: a bad value must fail here, not once a second node is added."""
        port = self.endpoint[1]
        if self.multi_node and port == 0:
            raise ArgumentError(f"--rdzv-endpoint {self.rdzv_endpoint!r}: port 0 picks a "
                                f"free port the other nodes cannot know; give the port "
                                f"every node uses")
        for key, raw in self.rdzv_conf:
            if key not in RDZV_CONF_KEYS:
                known = ", ".join(f"{k} ({v})" for k, v in RDZV_CONF_KEYS.items())
                raise ArgumentError(f"--rdzv-conf {key}={raw}: tandemrun does not read "
                                    f"{key!r}; it reads {known}")
            value = self.conf(key, 0.0)
            need = RDZV_CONF_KEYS[key]
            if (need.endswith("> 0") and value == 0
                    or need.endswith(">= 0.001") and value < MIN_MONITOR_INTERVAL  # a spin
                    or need.startswith("an int") and (value < 1 or value != int(value))):
                raise ArgumentError(f"--rdzv-conf {key}={raw}: must be {need}")

    @property
    def endpoint(self) -> tuple[str, int]:
        """The rendezvous store's (host, port): ``--rdzv-endpoint`` when given (for the
        static backend too, as torchrun), else ``--master-addr``/``--master-port``
        (static: 29500) or ``--master-addr`` and 29400 (c10d)."""
        if self.rdzv_endpoint:
            return parse_endpoint(self.rdzv_endpoint, 29400 if self.rdzv_backend == "c10d"
                                  else 29500)
        if self.rdzv_backend == "c10d":
            return self.master_addr, 29400
        return self.master_addr, 29500 if self.master_port is None else self.master_port

    def _check_bounds(self, fit: int | None) -> None:
        """The counts and durations against their upper bounds, before anything starts."""
        if fit is not None:
            # spares run beside the workers: a typo here forked processes until the
            # launcher could start no thread, and died
            at_most("--spares", self.spares, max(0, fit - self.nproc_per_node),
                    f"this host's available memory holds at most about {fit} workers at "
                    f"{WORKER_MEMORY >> 20} MiB each, and --nproc-per-node "
                    f"{self.nproc_per_node} of them train",
                    "keep fewer spares per node (one takes a lost worker's place at once)")
        at_most("--nnodes", self.max_nodes, MAX_WORLD_SIZE // self.nproc_per_node,
                f"MAX_WORLD_SIZE ({MAX_WORLD_SIZE}) ranks, at --nproc-per-node "
                f"{self.nproc_per_node}", "give the number of nodes the job runs on")
        at_most("--max-restarts", self.max_restarts, MAX_RESTARTS,
                "every restart keeps its own log files; a job failing this often has a bug "
                "a restart will not fix", "give a smaller budget")
        at_most("--monitor-interval", self.monitor_interval, MAX_SECONDS,
                "seconds, a day", "check the workers more often")
        at_most("--shutdown-timeout", self.shutdown_timeout, MAX_SECONDS,
                "seconds, a day", "give the workers less time to stop")

        if self.module and self.no_python:
            raise ArgumentError("-m/--module and --no-python cannot be used together")
        if self.standalone and self.max_nodes != 1:
            raise ArgumentError("--standalone is a single-node job; drop --nnodes or use 1")

    def check_script(self) -> None:
        """Refuse a training script that is not there, once, before any worker starts (each
        worker would otherwise fail on it, and the job be reported as a failed job)."""
        if self.module or self.no_python or os.path.exists(self.entrypoint):
            return  # python also runs a directory or a zip file holding __main__.py
        raise ArgumentError(f"training script {self.entrypoint!r} not found "
                            f"(in {os.getcwd()}); give its path, or -m for a module")

    @property
    def nnodes(self) -> int:
        return self.max_nodes

    @property
    def multi_node(self) -> bool:
        return self.max_nodes > 1

    def conf(self, key: str, default: float) -> float:
        """A numeric ``--rdzv-conf`` entry (e.g. ``join_timeout``), seconds."""
        raw = dict(self.rdzv_conf).get(key)
        try:
            value = default if raw is None else float(raw)
        except ValueError as exc:
            raise ArgumentError(f"--rdzv-conf {key}={raw!r} is not a number") from exc
        if not value >= 0:  # NaN too: a deadline made from it never passes
            raise ArgumentError(f"--rdzv-conf {key}={raw!r} must be a number >= 0")
        # infinity too: a wait on it fails mid-call with OverflowError
        return at_most(f"--rdzv-conf {key}", value, threading.TIMEOUT_MAX,
                       "the longest wait this platform allows, in seconds",
                       "give a finite number of seconds")

    def filter_note(self) -> str | None:
        """What to tell a user whose ``--local-ranks-filter`` names ranks this node does
        not run (the same command line may serve nodes of different sizes: not an error)."""
        missing = sorted(r for r in self.local_ranks_filter or () if r >= self.nproc_per_node)
        if not missing:
            return None
        return (f"--local-ranks-filter names local rank(s) {', '.join(map(str, missing))}, "
                f"but this node runs local ranks 0-{self.nproc_per_node - 1}")

    def console_for(self, local_rank: int, stream: Std) -> bool:
        """Whether a stream of this local rank is shown on the launcher's console."""
        if self.local_ranks_filter is not None and local_rank not in self.local_ranks_filter:
            return False
        if self.tee.for_rank(local_rank) & stream:
            return True
        return not self.redirects.for_rank(local_rank) & stream

    @property
    def keeps_files(self) -> bool:
        """-r/-t need per-rank log files even without --log-dir (a temporary one is made)."""
        return self.log_dir is not None or self.redirects != StdMap() or self.tee != StdMap()


def parse_nnodes(text: str) -> tuple[int, int]:
    """``"2"`` -> (2, 2); ``"1:4"`` -> (1, 4)."""
    parts = str(text).split(":")
    try:
        if len(parts) == 1:
            return int(parts[0]), int(parts[0])
        if len(parts) == 2:
            return int(parts[0]), int(parts[1])
    except ValueError:
        pass
    raise ArgumentError(f"--nnodes {text!r}: expected N or MIN:MAX")


def _visible_gpus() -> int:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    try:
        return len([n for n in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", n)])
    except OSError:
        return 0


def parse_nproc(text: str) -> int:
    """An int, ``cpu`` (os.cpu_count()), ``gpu`` (visible GPUs) or ``auto`` (GPUs, else CPUs)."""
    text = str(text).strip()
    if text.isdigit() or text[:1] == "-" and text[1:].isdigit():
        return int(text)  # a negative count is refused with the bounds, like 0
    if text == "cpu":
        return os.cpu_count() or 1
    if text in ("gpu", "cuda"):
        count = _visible_gpus()
        if not count:
            raise ArgumentError(f"--nproc-per-node {text}: no GPU is visible")
        return count
    if text == "auto":
        return _visible_gpus() or os.cpu_count() or 1
    raise ArgumentError(f"--nproc-per-node {text!r}: expected an int, auto, cpu or gpu")


def parse_endpoint(text: str, default_port: int) -> tuple[str, int]:
    """``--rdzv-endpoint``: ``HOST``, ``HOST:PORT``, ``[IPV6]:PORT`` or a bare IPv6 address."""
    text = text.strip()
    bracketed = re.fullmatch(r"\[([^\]]+)\](?::(.*))?", text)
    if bracketed:
        host, port = bracketed.group(1), bracketed.group(2)
    elif text.count(":") > 1 and "[" not in text and "]" not in text:
        host, port = text, None  # an IPv6 address without a port
    else:
        host, sep, port = text.partition(":") if text.count(":") == 1 else (text, "", None)
    if not host or "[" in host or "]" in host or " " in host:
        raise ArgumentError(f"--rdzv-endpoint {text!r}: expected HOST, HOST:PORT or "
                            f"[IPV6]:PORT")
    if port is None:
        return host, default_port
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ArgumentError(f"--rdzv-endpoint {text!r}: the port must be 0..65535 "
                            f"(0: any free port, one node only), got {port!r}")
    return host, int(port)


# what a launcher cannot handle, or needs for itself (its workers' exits)
UNHANDLED_SIGNALS = {signal.SIGKILL: "it cannot be caught", signal.SIGSTOP: "it cannot be caught",
                     signal.SIGCHLD: "the launcher learns of its workers' exits by it"}


def parse_signals(text: str) -> tuple[int, ...]:
    """``"SIGTERM,SIGINT"`` -> the signal numbers."""
    out = []
    for name in filter(None, (p.strip().upper() for p in text.split(","))):
        name = name if name.startswith("SIG") else "SIG" + name
        try:
            number = signal.Signals[name]
        except KeyError as exc:
            raise ArgumentError(f"--signals-to-handle: unknown signal {name}") from exc
        if number in UNHANDLED_SIGNALS:
            raise ArgumentError(f"--signals-to-handle: {name} cannot be forwarded to the "
                                f"workers: {UNHANDLED_SIGNALS[number]}; leave it out")
        out.append(int(number))
    return tuple(out)


def parse_rdzv_conf(text: str) -> tuple[tuple[str, str], ...]:
    """``"join_timeout=60,last_call_timeout=5"`` -> pairs."""
    pairs = []
    for item in filter(None, (p.strip() for p in (text or "").split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ArgumentError(f"--rdzv-conf {item!r}: expected key=value")
        pairs.append((key.strip(), value.strip()))
    return tuple(pairs)


def parse_ranks(text: str) -> frozenset[int] | None:
    """``--local-ranks-filter 0,1`` -> {0, 1}; empty -> None (every rank)."""
    if not text:
        return None
    try:
        ranks = frozenset(int(p) for p in text.split(",") if p.strip())
    except ValueError as exc:
        raise ArgumentError(
            f"--local-ranks-filter {text!r}: expected comma-separated ints like 0,1") from exc
    if any(r < 0 for r in ranks):
        raise ArgumentError(f"--local-ranks-filter {text!r}: local ranks are >= 0 (a "
                            f"negative one would hide every rank's output)")
    return ranks or None
