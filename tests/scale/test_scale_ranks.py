"""16 and 32 ranks, on one host and on 2 and 4 simulated hosts (``tandem.testing.netns``):
every collective against the naive oracle, and what each rank holds afterwards.

One launch per layout (cached for the module) serves every test of that layout. The
connection targets: no TCP between ranks of one host (shared memory only); across
hosts O(hosts) connections per host, not O(world); descriptors and threads per rank
growing with ranks per host and hosts, never with the world size.
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest

import _scale_ranks
from tandem.testing import launch
from tandem.testing.netns import Unavailable, netns_lab

pytestmark = [pytest.mark.procs, pytest.mark.timeout(120)]

SIZES = [1000, 70_000]  # elements: an odd small size and one past the small-message paths
_runs: dict[str, list[dict[str, Any]]] = {}


@contextlib.contextmanager
def hosts(count: int, workdir: Path) -> Iterator[tuple[list[str], list[str]]]:
    """The namespaces and addresses of ``count`` simulated hosts (none for one host)."""
    if count == 1:
        yield [], []
        return
    try:
        with netns_lab(count, workdir) as lab:
            yield lab.names, lab.addrs
    except Unavailable as exc:
        pytest.skip(f"simulated hosts are unavailable here: {exc}")


def run(layout: str) -> list[dict[str, Any]]:
    """Every rank's :func:`_scale_ranks.battery` result on ``layout`` (HOSTSxRANKS)."""
    if layout not in _runs:
        count, per_host = (int(x) for x in layout.split("x"))
        with tempfile.TemporaryDirectory(prefix="tandem-scale-") as tmp:
            with hosts(count, Path(tmp)) as (names, addrs):
                outcomes = launch(count * per_host, _scale_ranks.battery,
                                  (f"{tmp}/store", names, addrs, per_host, SIZES), init=False,
                                  timeout=100)
        bad = [o for o in outcomes if not o.ok]
        assert not bad, "\n".join(f"--- rank {o.rank} ({o.error_type}) ---\n{o.error[-3000:]}"
                                  for o in bad[:3])
        _runs[layout] = [o.value for o in outcomes]
    return _runs[layout]


@pytest.mark.parametrize("layout", ["1x16", "4x8"])
def test_every_collective_matches_the_naive_oracle(layout: str) -> None:
    wrong = {r: v["wrong"] for r, v in enumerate(run(layout)) if v["wrong"]}
    assert not wrong, wrong


@pytest.mark.parametrize("layout", ["1x16", "2x8"])
def test_ranks_of_one_host_have_no_tcp_between_them(layout: str) -> None:
    local = {r: v["local_tcp"] for r, v in enumerate(run(layout)) if v["local_tcp"]}
    assert not local, f"same-host TCP connections per rank: {local}"


def _per_host(layout: str) -> list[int]:
    count, per_host = (int(x) for x in layout.split("x"))
    values = run(layout)
    return [sum(v["remote_tcp"] for v in values[h * per_host:(h + 1) * per_host])
            for h in range(count)]


def test_connections_across_hosts_grow_with_hosts_not_with_the_world() -> None:
    for layout, count in (("2x8", 2), ("4x8", 4)):
        per_host = _per_host(layout)
        assert max(per_host) <= 2 * (count - 1), (
            f"{layout}: {per_host} TCP connections per host to other hosts; target "
            f"2*(hosts-1) = {2 * (count - 1)}")


def test_connections_across_hosts_are_seen_by_the_count() -> None:
    # the count the targets rest on finds connections where there must be some
    for layout in ("2x8", "4x8"):
        assert min(_per_host(layout)) > 0, (layout, _per_host(layout))


def _growth(what: str) -> int:
    """How much more of ``what`` the rank holding most of it has at 4x8 than at 2x8."""
    return max(v[what] for v in run("4x8")) - max(v[what] for v in run("2x8"))


def test_threads_per_rank_do_not_grow_with_the_world() -> None:
    # tcp runs one reader, one sender and its listener's gate whatever the peers
    grew = _growth("threads")
    most = {layout: max(run(layout), key=lambda v: v["threads"])["thread_names"]
            for layout in ("2x8", "4x8")}
    assert grew <= 2 * 2, f"threads per rank, from 2x8 to 4x8: +{grew}; the most: {most}"


def test_descriptors_per_rank_do_not_grow_with_the_world() -> None:
    grew = _growth("fds")
    assert grew <= 2 * 2, f"descriptors per rank, from 2x8 to 4x8: +{grew}"
