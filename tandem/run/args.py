"""torchrun's command line, in both spellings, with ``PET_<FLAG>`` environment defaults.

::

    python -m tandem.run --nproc-per-node 2 train.py --lr 0.1
    PET_NPROC_PER_NODE=2 tandemrun train.py          # same; the command line wins
    srun --ntasks-per-node=1 tandemrun --nproc-per-node 2 train.py   # nodes from SLURM

Flags win over ``PET_*`` variables, which win over what a scheduler says: SLURM's
step (:func:`slurm_defaults`) and Kubernetes training operators' pods
(:func:`operator_defaults`). :func:`parse` turns argv into a
:class:`tandem.run.config.LaunchConfig`.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
from typing import Any, Callable, Mapping, NamedTuple, NoReturn, Sequence

from tandem.collectives.cluster_env import (env_int, first_host, port_from_id,
                                            slurm_node_address)
from tandem.config import MAX_WORLD_SIZE
from tandem.errors import ArgumentError
from tandem.run.config import (
    START_METHODS,
    LaunchConfig,
    StdMap,
    parse_nnodes,
    parse_nproc,
    parse_rdzv_conf,
    parse_ranks,
    parse_signals,
)

__all__ = ["build_parser", "parse", "slurm_defaults", "operator_defaults"]

DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2"


class _FromEnv(NamedTuple):
    """A flag's value as its ``PET_<DEST>`` variable gave it; not a str, so argparse leaves
    it to :func:`_take_env`, which names the variable when it is wrong."""
    name: str
    raw: str


class _Env(argparse.Action):
    """A valued flag whose default comes from ``PET_<DEST>`` when that variable is set."""

    def __init__(self, dest: str, default: Any = None, **kwargs: Any) -> None:
        name = f"PET_{dest.upper()}"
        if name in os.environ:
            default = _FromEnv(name, os.environ[name])
        super().__init__(dest=dest, default=default, **kwargs)

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        setattr(namespace, self.dest, values)


FLAG_WORDS = {"1": True, "true": True, "yes": True, "on": True,
              "0": False, "false": False, "no": False, "off": False, "": False}


class _EnvFlag(argparse.Action):
    """A store-true flag that ``PET_<DEST>=1`` (or true/yes) also switches on."""

    def __init__(self, dest: str, **kwargs: Any) -> None:
        name = f"PET_{dest.upper()}"
        raw = os.environ.get(name, "0").strip().lower()
        if raw not in FLAG_WORDS:
            # a word read as false would drop the setting without a word
            raise ArgumentError(f"{name}={os.environ[name]!r}: expected one of "
                                f"{', '.join(sorted(w for w in FLAG_WORDS if w))}")
        super().__init__(dest=dest, nargs=0, const=True, default=FLAG_WORDS[raw], **kwargs)

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        setattr(namespace, self.dest, True)


class _Refused(argparse.Action):
    """A torchrun flag for something tandem does not have: given, it stops the launch
    with what to do instead (never silently dropped)."""

    def __init__(self, why: str, **kwargs: Any) -> None:
        self.why = why
        super().__init__(default=None, help=f"refused: {why}", **kwargs)

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        parser.error(f"{option} is a torchrun flag tandemrun does not support: {self.why}")


# torchrun's flags for what tandemrun lacks, with why and what to do instead
REFUSED_FLAGS = {
    "event-log-handler": ("torchelastic's event handlers do not exist here; the launcher's "
                          "summary and --log-dir record each worker's end", None),
    "logs-specs": ("torchelastic's LogsSpecs plugins do not exist here; use --log-dir, "
                   "-r/--redirects, -t/--tee and --local-ranks-filter", None),
    "duplicate-stdout-filters": ("copy matching lines with --log-dir (every rank's stdout.log) "
                                 "and grep", None),
    "duplicate-stderr-filters": ("copy matching lines with --log-dir (every rank's stderr.log) "
                                 "and grep", None),
    "numa-binding": ("it binds workers to CPUs near their GPUs, and tandem's workers use no "
                     "GPU; run tandemrun under numactl or taskset (workers inherit the "
                     "binding)", None),
    "virtual-local-rank": ("it maps each worker's GPU to device 0, and tandem's workers use "
                           "no GPU", 0),
}


def _both(name: str) -> list[str]:
    """``--nproc-per-node`` and ``--nproc_per_node``."""
    spellings = [f"--{name}"]
    if "-" in name:
        spellings.append("--" + name.replace("-", "_"))
    return spellings


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """Name the flag an unknown one was probably meant to be: the flag it begins (no
        abbreviations are taken: ``--nproc`` is refused, not read as ``--nproc-per-node``),
        or else the closest spelling."""
        unknown = message.split("unrecognized arguments:")[1:]
        meant = _meant(unknown[0].split() if unknown else [], self._flags())
        super().error(message + (f" (did you mean {meant}?)" if meant else ""))

    def _flags(self) -> list[str]:
        return [f for a in self._actions for f in a.option_strings if f.startswith("--")]


def _meant(words: Sequence[str], flags: Sequence[str]) -> str | None:
    for word in words:
        given = word.split("=")[0]
        if not given.startswith("--") or given in flags:
            continue
        begun = [f for f in flags if f.startswith(given)]
        close = begun or difflib.get_close_matches(given, flags, n=1)
        if close:
            return close[0]
    return None


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="tandemrun",
        description="Launch a tandem (or torch.distributed) script on one or many nodes; "
                    "accepts torchrun's flags. Every flag may also be given as PET_<FLAG>.",
        allow_abbrev=False)
    add = p.add_argument
    add(*_both("nnodes"), action=_Env, default="1", help="N or MIN:MAX nodes (default 1)")
    add(*_both("nproc-per-node"), action=_Env, default="1",
        help="workers per node: an int, auto, cpu or gpu (default 1)")
    add(*_both("node-rank"), action=_Env, type=int, default=0,
        help="this node's rank for static multi-node jobs (default 0)")
    add(*_both("master-addr"), action=_Env, default="127.0.0.1",
        help="node 0's address (static rendezvous; default 127.0.0.1)")
    add(*_both("master-port"), action=_Env, type=int, default=None,
        help="node 0's port: the agents' store for multi-node, the workers' MASTER_PORT "
             "for one node (default: a free port; 29500 for static multi-node)")
    add(*_both("local-addr"), action=_Env, default=None,
        help="this node's address as other nodes reach it (c10d rendezvous)")
    add("--standalone", action=_EnvFlag,
        help="single-node job on 127.0.0.1 with a free port (several may share a host)")
    add(*_both("rdzv-backend"), action=_Env, default="static", help="static (default) or c10d")
    add(*_both("rdzv-endpoint"), action=_Env, default="", help="HOST:PORT of the c10d store")
    add(*_both("rdzv-id"), action=_Env, default="", help="job id shared by all nodes")
    add(*_both("rdzv-conf"), action=_Env, default="",
        help="key=value,...: join_timeout (600 s)")
    add(*_both("max-restarts"), action=_Env, type=int, default=0,
        help="restart the worker group this many times on failure (default 0, at most "
             "10000)")
    add("--spares", action=_Env, type=int, default=0,
        help="tandem only, for scripts that train under tandem.elastic.run_elastic: workers "
             "per node started once the job runs, each ready to take a lost worker's place "
             "at once (default 0); a lost worker is otherwise replaced by a new one "
             "(each replacement counts against --max-restarts); with --nproc-per-node, at "
             "most the workers this host's available memory holds")
    add(*_both("no-warm-start"), action=_EnvFlag,
        help="tandem only: start every worker as a new interpreter that imports torch "
             "itself; by default, with two or more workers per node, the workers (and "
             "later restarts, replacements and spares) are forked from one process per "
             "node that imported torch and tandem once for all of them (with one worker "
             "per node: only the replacements and spares of a job under "
             "tandem.elastic.run_elastic)")
    add(*_both("monitor-interval"), action=_Env, type=float, default=0.1,
        help="seconds between worker health checks (default 0.1)")
    add(*_both("shutdown-timeout"), action=_Env, type=float, default=5.0,
        help="seconds between SIGTERM and SIGKILL when stopping workers (default 5)")
    add(*_both("signals-to-handle"), action=_Env, default=DEFAULT_SIGNALS,
        help=f"signals forwarded to every worker (default {DEFAULT_SIGNALS})")
    add(*_both("start-method"), action=_Env, default="spawn",
        help="accepted for torchrun compatibility; workers are always new processes")
    add("--role", action=_Env, default="default", help="ROLE_NAME of the workers")
    add("-m", "--module", action=_EnvFlag, help="run the target as a module (python -m)")
    add(*_both("no-python"), action=_EnvFlag,
        help="run the target as an executable, not a Python script")
    add(*_both("run-path"), action=_EnvFlag,
        help="accepted for torchrun compatibility (scripts always run through runpy)")
    add(*_both("log-dir"), action=_Env, default=None,
        help="keep <log-dir>/<run_id>/attempt_<n>/rank_<r>/{stdout,stderr}.log")
    add("-r", "--redirects", action=_Env, default="0",
        help="send streams to the log files only: 0 none, 1 out, 2 err, 3 both, or 0:3,1:1")
    add("-t", "--tee", action=_Env, default="0",
        help="show streams on the console and in the log files (same values as -r)")
    add(*_both("local-ranks-filter"), action=_Env, default="",
        help="comma-separated local ranks whose output reaches the console")
    for flag, (why, nargs) in REFUSED_FLAGS.items():
        add(*_both(flag), action=_Refused, why=why, nargs=nargs, dest=f"refused_{flag}",
            metavar="VALUE")
    add("training_script", help="the script (or module with -m, program with --no-python)")
    add("training_script_args", nargs=argparse.REMAINDER)
    return p


def slurm_defaults(env: Mapping[str, str],
                   resolve: Callable[[str], str] = slurm_node_address) -> dict[str, Any]:
    """The multi-node flags of one launcher per node under ``srun`` (empty elsewhere).

    ``srun --ntasks-per-node=1 tandemrun --nproc-per-node 2 train.py`` starts one
    tandemrun per node of the step; each takes ``--nnodes`` = ``SLURM_STEP_NUM_NODES``,
    ``--node-rank`` = ``SLURM_NODEID``, ``--master-addr`` = the step's first node
    (resolved as :func:`tandem.collectives.cluster_env.slurm_node_address` does),
    ``--master-port`` = ``10000 + SLURM_JOB_ID % 20000``, ``--rdzv-endpoint`` = both
    (for ``--rdzv-backend c10d``) and ``--rdzv-id`` = ``slurm-JOBID``. Flags and
    ``PET_*`` variables win. Several launchers on one node would share its node rank:
    that is refused here, with the fix.
    """
    if not (env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_STEP_NUM_TASKS")):
        return {}  # not a task of an srun step (a batch script's shell has no STEP_ values)
    # in a step, a value unset or wrong is named, never taken for "no srun step"
    fix = "fix or unset it, or give tandemrun's flags"
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")
    if not nodelist.strip():
        raise ArgumentError(f"tandemrun under srun: SLURM_STEP_NODELIST and SLURM_JOB_NODELIST "
                            f"are unset or empty: expected the step's nodes in SLURM's notation, "
                            f"e.g. gpu[07-08]; {fix}")
    nodes = env_int(env, "SLURM_STEP_NUM_NODES", 1, MAX_WORLD_SIZE,
                    f"the step's node count, 1..{MAX_WORLD_SIZE}; {fix}")
    tasks = env_int(env, "SLURM_STEP_NUM_TASKS", 1, MAX_WORLD_SIZE,
                    f"the step's task count, 1..{MAX_WORLD_SIZE}; {fix}")
    job = env_int(env, "SLURM_JOB_ID", 0, 2**63 - 1, f"the job's id, an integer >= 0; {fix}")
    node = env_int(env, "SLURM_NODEID", 0, nodes - 1,
                   f"this node's index in the step, 0..SLURM_STEP_NUM_NODES-1 = {nodes - 1}; "
                   f"{fix}")
    if tasks != nodes:
        raise ArgumentError(
            f"tandemrun under srun: this step runs {tasks} tasks on {nodes} node(s) "
            f"(SLURM_STEP_NUM_TASKS, SLURM_STEP_NUM_NODES); start one tandemrun per node "
            f"(srun --ntasks-per-node=1 tandemrun --nproc-per-node N ...), or run the "
            f"script itself once per rank (srun --ntasks-per-node=N python train.py)")
    addr, port = resolve(first_host(nodelist)), port_from_id(job)
    return {"nnodes": str(nodes), "node_rank": node, "master_addr": addr, "master_port": port,
            "rdzv_endpoint": f"{addr}:{port}", "rdzv_id": f"slurm-{job}"}


def operator_defaults(env: Mapping[str, str]) -> dict[str, Any]:
    """Node 0's endpoint in a pod of a Kubernetes training operator (empty elsewhere).

    Kubeflow's PyTorchJob gives every pod ``PET_NNODES``, ``PET_NPROC_PER_NODE`` and
    ``PET_NODE_RANK`` (read like every ``PET_<FLAG>``) and the master's Service as
    ``MASTER_ADDR``/``MASTER_PORT``; releases before 1.8 set no ``PET_MASTER_ADDR``/
    ``PET_MASTER_PORT``, so there ``MASTER_ADDR``/``MASTER_PORT`` are node 0's endpoint.
    Only for a job that says it spans nodes (``PET_NNODES``): a single-node tandemrun
    never takes a stray MASTER_PORT. (Its ``RANK`` and ``WORLD_SIZE`` are the pod's
    index and the job's size; each worker gets its own.)
    """
    if not env.get("PET_NNODES"):
        return {}
    out: dict[str, Any] = {}
    if env.get("MASTER_ADDR") and not env.get("PET_MASTER_ADDR"):
        out["master_addr"] = env["MASTER_ADDR"]
    if env.get("MASTER_PORT") and not env.get("PET_MASTER_PORT"):
        out["master_port"] = env_int(env, "MASTER_PORT", 0, 65535,
                                     "node 0's port in a training operator's pod (PET_NNODES "
                                     "is set), 0..65535; fix it or give --master-port")
    return out


def parse(argv: Sequence[str] | None = None) -> LaunchConfig:
    """Parse ``argv`` (default ``sys.argv[1:]``); raise ``ArgumentError`` on bad values."""
    parser = build_parser()
    derived = {**operator_defaults(os.environ), **slurm_defaults(os.environ)}
    parser.set_defaults(**{k: v for k, v in derived.items()
                           if f"PET_{k.upper()}" not in os.environ})
    ns = parser.parse_args(argv)
    taken = _take_env(parser, ns)
    try:
        return _config(ns)
    except ArgumentError as exc:  # "--master-port must be ..." when PET_MASTER_PORT said it
        named = [f"environment variable {v.name}={v.raw!r} (tandemrun's {flag})"
                 for flag, v in taken.items() if re.search(re.escape(flag) + r"(?![\w-])",
                                                           str(exc))]
        if not named:
            raise
        raise ArgumentError(f"{', '.join(named)}: {exc}; fix or unset it") from exc


def _long_flag(action: argparse.Action) -> str:
    return next(f for f in action.option_strings if f.startswith("--"))


def _take_env(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> dict[str, _FromEnv]:
    """Put the values ``PET_*`` variables gave in ``ns``, converted as their flag's are
    (a wrong one names the variable); returns them by flag, for errors found later."""
    taken: dict[str, _FromEnv] = {}
    for action in parser._actions:
        value = getattr(ns, action.dest, None)
        if not isinstance(value, _FromEnv):
            continue
        flag = _long_flag(action)
        convert = action.type if callable(action.type) else str
        try:
            setattr(ns, action.dest, convert(value.raw))
        except ValueError as exc:
            kinds: dict[object, str] = {int: "an integer", float: "a number"}
            kind = kinds.get(convert, "valid")
            raise ArgumentError(f"environment variable {value.name}={value.raw!r} (tandemrun's "
                                f"{flag}) is not {kind}: fix or unset it") from exc
        taken[flag] = value
    return taken


def _config(ns: argparse.Namespace) -> LaunchConfig:
    """The launch configuration of parsed flags; ``ArgumentError`` naming a wrong one."""
    min_nodes, max_nodes = parse_nnodes(ns.nnodes)
    standalone = bool(ns.standalone)
    if standalone and (min_nodes, max_nodes) != (1, 1):
        raise ArgumentError("--standalone runs one node; drop --nnodes or set it to 1")
    nproc = parse_nproc(ns.nproc_per_node)
    if ns.start_method not in START_METHODS:
        raise ArgumentError(f"--start-method {ns.start_method!r}: expected one of "
                            f"{', '.join(START_METHODS)} (tandemrun starts every worker as "
                            f"a new process, whichever is given)")
    return LaunchConfig(
        entrypoint=ns.training_script,
        args=tuple(ns.training_script_args),
        nproc_per_node=nproc,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        node_rank=int(ns.node_rank),
        master_addr="127.0.0.1" if standalone else str(ns.master_addr),
        master_port=None if standalone or ns.master_port is None else int(ns.master_port),
        local_addr=ns.local_addr or None,
        standalone=standalone,
        rdzv_backend="static" if standalone else str(ns.rdzv_backend),
        rdzv_endpoint=str(ns.rdzv_endpoint or ""),
        rdzv_id=str(ns.rdzv_id or ""),
        rdzv_conf=parse_rdzv_conf(ns.rdzv_conf),
        max_restarts=int(ns.max_restarts),
        spares=int(ns.spares),
        warm_start=not ns.no_warm_start,
        monitor_interval=float(ns.monitor_interval),
        shutdown_timeout=float(ns.shutdown_timeout),
        role=str(ns.role),
        module=bool(ns.module),
        no_python=bool(ns.no_python),
        log_dir=ns.log_dir or None,
        redirects=StdMap.parse(ns.redirects, "--redirects"),
        tee=StdMap.parse(ns.tee, "--tee"),
        local_ranks_filter=parse_ranks(ns.local_ranks_filter),
        signals=parse_signals(ns.signals_to_handle),
    )
