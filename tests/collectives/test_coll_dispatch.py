"""Which algorithm every collective runs, for every size, host layout and transport.

The oracle is ``dispatch_table.json``: made by :func:`table` from the code as it was
before the algorithm choices moved out of ``api.py`` into one place
(``tandem/collectives/algorithms/select.py``), and kept since. A change of choice,
deliberate or not, shows here as the entries that differ; regenerate the table with
``python tests/collectives/test_coll_dispatch.py --write`` only for a deliberate one.

Nothing moves between processes: each call runs on a stand-in group whose transport
answers every message at once, and every algorithm that would move data only records
that it was called (its name, the ranks it ran among, its settings). Every rank of
every layout is asked, as ranks may differ (roots, host leaders).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
from typing import Any, Callable, Iterator

import pytest
import torch

from tandem.collectives import alltoall, api, barriers
from tandem.collectives import algorithms as algo
from tandem.collectives.group import Op, ProcessGroup
from tandem.collectives.reduce_op import ReduceOp
from tandem.config import Settings
from tandem.transport.message import Slot

# modules by path: the package's names "ring" and "direct" are functions, not these
(direct, doubling, leaders, leaders_barrier, naive, ring, roots, shm, shm_gather, shm_rooted,
 spanning, streamed, tree) = (importlib.import_module(f"tandem.collectives.algorithms.{name}")
                              for name in ("direct", "doubling", "leaders", "leaders_barrier",
                                           "naive", "ring", "roots", "shm", "shm_gather",
                                           "shm_rooted", "spanning", "streamed", "tree"))

# CPU time ~10 s; the wall time grows with the machine's load
pytestmark = pytest.mark.timeout(900)

TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dispatch_table.json")

# the functions that would move data: recorded, not run
LEAVES: list[Callable[..., Any]] = [
    naive.naive_all_reduce, doubling.doubling_all_reduce, ring.ring_all_reduce,
    shm.shm_all_reduce, shm.shm_all_reduce_many, shm.shm_barrier, shm_rooted.shm_broadcast, shm_rooted.shm_reduce,
    shm_gather.shm_all_gather, shm_gather.shm_reduce_scatter, tree.tree_broadcast,
    tree.tree_reduce, ring.ring, ring.ring_gather_into, streamed.streamed_all_reduce,
    streamed.two_level_all_reduce,
    streamed._through_leaders, direct.direct_gather, direct.direct_scatter,
    direct.pairwise_all_to_all, alltoall._agree, roots.confirm_root, roots.announce_root,
    spanning.confirmed_broadcast, leaders_barrier.leaders_barrier, leaders.leaders_reduce,
    leaders.leaders_gather, leaders.leaders_scatter, leaders.leaders_all_to_all,
]
# recorded without leading underscores, so a helper may move and lose its "_"
_EMPTY: dict[str, Any] = {"confirm_root": [], "announce_root": []}

# name -> (ranks' hosts, whether the group shares memory)
LAYOUTS: dict[str, tuple[str, bool]] = {
    "1": ("a", False),
    "2-tcp": ("aa", False),
    "2-shm": ("aa", True),
    "3-tcp": ("aaa", False),
    "3-shm": ("aaa", True),
    "4-tcp": ("aaaa", False),
    "4-shm": ("aaaa", True),
    "2-hosts": ("ab", False),
    "4-hosts": ("abcd", False),
    "2x2": ("aabb", False),
    "interleaved": ("abab", False),
    "3+1": ("aaab", False),
    "1+2": ("abb", False),
    "unknown-host": ("aa?b", False),
}
NUMELS = [0, 1, 1024, 32 << 10, 128 << 10, 512 << 10, 1 << 20, 2 << 20]  # float32 elements
FORCED = ["naive", "doubling", "ring", "hierarchical", "shm", "nonesuch"]
OVERRIDDEN = ["ring", "shm"]  # forced through group.algorithm_override, not the setting
FORCED_NUMELS = [1, 128 << 10, 1 << 20]


class _Transport:
    """Every message completes at once; hosts as the layout says."""

    def __init__(self, rank: int, hosts: str) -> None:
        self.rank = rank
        self.hosts = hosts

    def host_of(self, rank: int) -> str:
        return "" if self.hosts[rank] == "?" else self.hosts[rank]

    def shares_memory_with(self, ranks: Any) -> bool:
        return False  # no arena: a host's part of a broadcast goes by messages

    def _done(self, peer: int) -> Slot:
        slot = Slot(peer, (0, 0, 0, 0), None, b"")  # type: ignore[arg-type]
        slot.finish(None)
        return slot

    def isend(self, to: int, header: Any, view: memoryview) -> Slot:
        return self._done(to)

    def irecv(self, frm: int, *args: Any) -> Slot:
        return self._done(frm)


class _Group(ProcessGroup):
    """A group of ``len(hosts)`` ranks seen from ``rank``: calls run inline, at once."""

    def __init__(self, rank: int, hosts: str, shares: bool, settings: Settings) -> None:
        self.transport = _Transport(rank, hosts)  # type: ignore[assignment]
        self.ranks = list(range(len(hosts)))
        self.group_id, self.group_name = 1, "dispatch"
        self.group_rank, self.group_size = rank, len(hosts)
        self.settings = settings
        self.algorithm_override = {}
        self.shares_memory = shares
        self._scratch = torch.empty(0, dtype=torch.uint8)

    def new_op(self, name: str, sig: str, site: str) -> Op:
        return Op(self, name, 0, sig.encode(), b"")

    def run(self, op: Op, fn: Callable[[Op], Any], async_op: bool, result: Any = None,
            nbytes: int = -1) -> None:
        fn(op)


def _arg(value: Any) -> Any:
    """What of an algorithm's argument the table keeps (sizes and flags, not data)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, ReduceOp):
        return value.name
    if isinstance(value, (list, tuple)) and all(isinstance(v, (int, list, tuple)) for v in value):
        return [_arg(v) for v in value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, torch.Tensor) for v in value):
        return [v.numel() for v in value]
    if isinstance(value, torch.Tensor):
        return f"T{value.numel()}"
    return "?"


_HOLDERS: dict[int, list[tuple[Any, str, Any]]] = {}


def _holders() -> list[tuple[Any, str, Any]]:
    """(module, name, leaf) wherever tandem.collectives holds a leaf; scanned again only
    once a module was imported since (a scan per call was most of the table's time)."""
    if len(sys.modules) not in _HOLDERS:
        leaves = {id(fn) for fn in LEAVES}
        _HOLDERS.clear()
        _HOLDERS[len(sys.modules)] = [
            (module, attr, value) for name, module in list(sys.modules.items())
            if name.startswith("tandem.collectives") and module is not None
            for attr, value in list(vars(module).items()) if id(value) in leaves]
    return _HOLDERS[len(sys.modules)]


@contextlib.contextmanager
def _recording(calls: list[str]) -> Iterator[None]:
    """Replace every leaf wherever tandem.collectives holds it by one that records."""
    wrappers: dict[int, Callable[..., Any]] = {}
    for fn in LEAVES:
        def record(*args: Any, _name: str = fn.__name__.lstrip("_"), **kwargs: Any) -> Any:
            op = args[0]
            parts = [_name, "among", ",".join(map(str, op.group.ranks))]
            parts += [json.dumps(_arg(a)) for a in args[1:]]
            parts += [f"{k}={json.dumps(_arg(v))}" for k, v in sorted(kwargs.items())]
            calls.append(" ".join(parts))
            if _name == "agree":  # no sends made early; every rank sends every rank nothing
                return {}, [[0] * op.group.group_size] * op.group.group_size
            return _EMPTY.get(_name)
        wrappers[id(fn)] = record
    saved = _holders()
    for module, attr, value in saved:
        setattr(module, attr, wrappers[id(value)])
    registry = dict(algo.ALL_REDUCE)
    for key, value in registry.items():
        if id(value) in wrappers:
            algo.ALL_REDUCE[key] = wrappers[id(value)]
    try:
        yield
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)
        algo.ALL_REDUCE.clear()
        algo.ALL_REDUCE.update(registry)


def _calls(g: _Group, n: int, root: int) -> dict[str, Callable[[], Any]]:
    """Each collective and variant, called on ``g`` with ``n`` elements per rank."""
    p, r = g.group_size, g.group_rank
    x = lambda k=n: torch.empty(k)  # noqa: E731 - the values choose nothing
    one = torch.empty(n * p)
    views = list(one.split(n)) if n else [torch.zeros(0) for _ in range(p)]
    return {
        "broadcast": lambda: api.broadcast(x(), group_src=root, group=g),
        "all_reduce": lambda: api.all_reduce(x(), group=g),
        "all_reduce_coalesced": lambda: api.all_reduce_coalesced([x(), x(3)], group=g),
        "reduce": lambda: api.reduce(x(), group_dst=root, group=g),
        "all_gather/separate": lambda: api.all_gather([x() for _ in range(p)], x(), group=g),
        "all_gather/views": lambda: api.all_gather(views, x(), group=g),
        "all_gather_into_tensor": lambda: api.all_gather_into_tensor(x(n * p), x(), group=g),
        "gather": lambda: api.gather(x(), [x() for _ in range(p)] if r == root else None,
                                     group_dst=root, group=g),
        "scatter": lambda: api.scatter(x(), [x() for _ in range(p)] if r == root else None,
                                       group_src=root, group=g),
        "reduce_scatter": lambda: api.reduce_scatter(x(), [x() for _ in range(p)], group=g),
        "reduce_scatter_tensor": lambda: api.reduce_scatter_tensor(x(), x(n * p), group=g),
        "all_to_all": lambda: alltoall.all_to_all([x() for _ in range(p)],
                                                  [x() for _ in range(p)], group=g),
        "all_to_all_single": lambda: alltoall.all_to_all_single(x(n * p), x(n * p), group=g),
        "barrier": lambda: barriers.barrier(group=g),
    }


def _outcome(call: Callable[[], Any]) -> list[str]:
    calls: list[str] = []
    with _recording(calls):
        try:
            call()
        except Exception as exc:  # a refused choice is part of the table
            calls.append(f"error {type(exc).__name__}")
    return calls


def table() -> dict[str, list[str]]:
    """Every (layout, setting, collective, size, rank, root) -> the algorithms it ran."""
    out: dict[str, list[str]] = {}
    torch.set_num_threads(1)
    for layout, (hosts, shares) in LAYOUTS.items():
        p = len(hosts)
        for r in range(p):
            for n in NUMELS:
                for root in sorted({0, p - 1}):
                    g = _Group(r, hosts, shares, Settings())
                    for name, call in _calls(g, n, root).items():
                        if root and name not in ("broadcast", "reduce", "gather", "scatter"):
                            continue
                        key = f"{layout} auto {name} n={n} rank={r} root={root}"
                        out[key] = _outcome(call)
                if n not in FORCED_NUMELS:
                    continue
                for forced in FORCED:  # TANDEM_ALGORITHM, or the group's override
                    g = _Group(r, hosts, shares, Settings(algorithm=forced))
                    if forced in OVERRIDDEN:
                        g = _Group(r, hosts, shares, Settings())
                        g.algorithm_override["all_reduce"] = forced
                    for name in ("all_reduce", "all_reduce_coalesced"):
                        out[f"{layout} {forced} {name} n={n} rank={r}"] = _outcome(
                            _calls(g, n, 0)[name])
            # a leader's receive areas that do not fit: the flat algorithms instead
            saved = streamed._STREAM_SCRATCH
            streamed._STREAM_SCRATCH = 64 << 10
            try:
                for n in NUMELS:
                    g = _Group(r, hosts, shares, Settings())
                    calls = _calls(g, n, 0)
                    for name in ("all_reduce", "reduce_scatter", "reduce_scatter_tensor",
                                 "all_gather/separate"):
                        out[f"{layout} small-stream-scratch {name} n={n} rank={r}"] = (
                            _outcome(calls[name]))
            finally:
                streamed._STREAM_SCRATCH = saved
    return out


def _encode(flat: dict[str, list[str]]) -> dict[str, Any]:
    """The table as stored: each distinct list of calls once, each key's ranks in one row."""
    traces = sorted({json.dumps(calls) for calls in flat.values()})
    index = {trace: i for i, trace in enumerate(traces)}
    rows: dict[str, dict[str, int]] = {}
    for key, calls in flat.items():
        head, _, rank = key.partition(" rank=")
        rest = rank.partition(" ")[2]
        rows.setdefault(f"{head} {rest}".strip(), {})[rank.split()[0]] = index[json.dumps(calls)]
    return {"traces": [json.loads(t) for t in traces], "rows": rows}


def _decode(stored: dict[str, Any]) -> dict[str, list[str]]:
    flat = {}
    for row, ranks in stored["rows"].items():
        head, _, root = row.partition(" root=")
        for rank, i in ranks.items():
            key = f"{head} rank={rank}" + (f" root={root}" if root else "")
            flat[key] = stored["traces"][i]
    return flat


def _stored() -> dict[str, list[str]]:
    with open(TABLE) as f:
        return _decode(json.load(f))


def test_every_choice_is_as_recorded() -> None:
    expected = _stored()
    got = table()
    changed = [f"{key}:\n  was {expected.get(key)}\n  now {got.get(key)}"
               for key in sorted(set(expected) | set(got)) if expected.get(key) != got.get(key)]
    assert not changed, f"{len(changed)} choices changed, e.g.\n" + "\n".join(changed[:8])


def test_table_covers_every_algorithm() -> None:
    """The oracle is not vacuous: each data-moving algorithm is chosen somewhere."""
    expected = _stored()
    assert len(expected) > 5000
    seen = {call.split()[0] for calls in expected.values() for call in calls}
    missing = {fn.__name__.lstrip("_") for fn in LEAVES} - seen
    assert not missing, f"no entry of the table runs {sorted(missing)}"


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/collectives/test_coll_dispatch.py --write")
    with open(TABLE, "w") as f:
        json.dump(_encode(table()), f, indent=0, sort_keys=True, separators=(",", ":"))
        f.write("\n")
