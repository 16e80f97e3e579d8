"""Shaped links between simulated hosts (``tandem.testing.netns`` with a ``LinkShape``).

The rate is measured as one TCP stream's payload throughput between two hosts; the
delay with pings (a round trip crosses two links' one-way delays); the loss as the
share of pings that got no reply. Needs root and iproute2; elsewhere the lab tests
skip, saying why. About 25 s on 2 cores.
"""

from __future__ import annotations

import os
import signal
import statistics
from pathlib import Path

import pytest

from tandem.testing.links import LinkShape
from tandem.testing.netns import LabError, NetnsLab, Unavailable, netns_lab
from tandem._proc import process_alive

pytestmark = pytest.mark.timeout(120)


class _Skipping:
    """``with lab(...)`` that skips the test, with the reason, where no lab can be made."""

    def __init__(self, workdir: Path, link: str, hosts: int = 2) -> None:
        self.cm = netns_lab(hosts, workdir, LinkShape.parse(link))

    def __enter__(self) -> NetnsLab:
        try:
            return self.cm.__enter__()
        except Unavailable as exc:
            pytest.skip(f"network namespaces are unavailable: {exc}")

    def __exit__(self, *exc: object) -> None:
        self.cm.__exit__(*exc)  # type: ignore[arg-type]


def test_link_shapes_parse_in_tc_units() -> None:
    assert LinkShape.parse("1gbit:0.2ms") == LinkShape(1e9, 2e-4, 0.0)
    assert LinkShape.parse("10gbit:1ms:0.5%") == LinkShape(1e10, 1e-3, 0.005)
    assert LinkShape.parse("100mbit") == LinkShape(1e8)
    assert LinkShape.parse("unshaped:50us") == LinkShape(0, 5e-5)
    assert str(LinkShape.parse("1gbit:0.2ms")) == "1gbit:0.2ms"
    assert LinkShape.parse("1gbit").rate_bytes == 125e6
    for bad in ("1gb", "1gbit:2", "1gbit:1ms:150%", "fast", "1gbit:1ms:1%:x"):
        with pytest.raises(ValueError):
            LinkShape.parse(bad)


@pytest.mark.procs
@pytest.mark.parametrize("link, rate", [("200mbit", 200e6), ("1gbit", 1e9), ("1gbit:1ms", 1e9)])
def test_measured_rate_is_near_the_configured_one(tmp_path: Path, link: str,
                                                                  rate: float) -> None:
    with _Skipping(tmp_path, link) as lab:
        measured = lab.throughput(0, 1, seconds=2.0)
        for _ in range(2):  # a busy machine starves the sender below the rate; a shaper never lifts it above
            if measured >= 0.8 * rate:
                break
            measured = max(measured, lab.throughput(0, 1, seconds=2.0))
    # TCP payload is ~95% of what tbf counts; a loaded machine starves the sender, a wrong unit is 8-10x off
    assert 0.6 * rate <= measured <= 1.2 * rate, f"{link}: {measured / 1e6:.0f} Mbit/s"


@pytest.mark.procs
@pytest.mark.parametrize("link, one_way", [("unshaped:1ms", 1e-3), ("1gbit:0.2ms", 2e-4)])
def test_pings_take_twice_the_configured_delay(tmp_path: Path, link: str, one_way: float) -> None:
    with _Skipping(tmp_path, link) as lab:
        rtts = [r for r in lab.ping(0, 1, count=30) if r is not None]
    assert len(rtts) == 30, "pings were lost on a link without loss"
    # never faster than the two delays; slower by up to 3 ms when netem's timers wait for a
    # busy CPU (1.4 ms seen at load 20), while a wrong unit is 10x off
    assert min(rtts) >= 2 * one_way, f"{link}: fastest round trip {min(rtts) * 1e3:.3f} ms"
    assert statistics.median(rtts) <= 2 * one_way + 3e-3, \
        f"{link}: median round trip {statistics.median(rtts) * 1e3:.3f} ms"


@pytest.mark.procs
def test_unshaped_links_add_no_delay(tmp_path: Path) -> None:
    with _Skipping(tmp_path, "unshaped") as lab:
        rtts = [r for r in lab.ping(0, 1, count=20) if r is not None]
    assert statistics.median(rtts) < 0.4e-3, f"median round trip {statistics.median(rtts) * 1e3} ms"


@pytest.mark.procs
def test_loss_drops_about_that_share_of_packets(tmp_path: Path) -> None:
    with _Skipping(tmp_path, "unshaped:0ms:20%") as lab:
        # a lost ping costs its whole wait; replies on this link come within a millisecond
        # (test_unshaped_links_add_no_delay), so a quarter second is plenty even on a
        # loaded machine, and a late reply counted lost moves the share up by 1% only
        rtts = lab.ping(0, 1, count=100, wait=0.25)
    lost = sum(r is None for r in rtts) / len(rtts)
    # a round trip survives two links: 0.8 * 0.8 = 64% of pings come back
    assert 0.15 <= lost <= 0.6, f"{lost:.0%} of pings lost"


@pytest.mark.procs
def test_a_dead_delay_process_is_reported_not_ignored(tmp_path: Path) -> None:
    with _Skipping(tmp_path, "unshaped:1ms") as lab:
        lab.check()
        os.killpg(lab._helpers[1].pid, signal.SIGKILL)
        lab._helpers[1].wait(10)
        with pytest.raises(LabError, match=r"host\(s\) \[1\]"):
            lab.ping(0, 1, count=1)


@pytest.mark.procs
def test_a_shaped_lab_leaves_no_process_or_namespace_behind(tmp_path: Path) -> None:
    with _Skipping(tmp_path, "1gbit:0.2ms", hosts=3) as lab:
        pids = [p.pid for p in lab._helpers]
        names = [*lab.names, lab.switch]
        assert len(pids) == 3
    assert not [p for p in pids if process_alive(p)]
    listing = Path("/run/netns")
    left = [n for n in names if (listing / n).exists()]
    assert not left, left


_BUFFERS = """
import socket, sys, time
from pathlib import Path
from tandem import _wire
me, addrs, out = int(sys.argv[1]), sys.argv[2].split(","), Path(sys.argv[3])
if me == 0:
    server = socket.create_server((addrs[0], 0))
    (out / "port.tmp").write_text(str(server.getsockname()[1]))
    (out / "port.tmp").rename(out / "port")
    sock, _ = server.accept()
    _wire.tune(sock)
else:
    deadline = time.monotonic() + 20
    while not (out / "port").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    sock = _wire.connect(addrs[0], int((out / "port").read_text()), 20, "host 0")
(out / f"rcvbuf{me}").write_text(str(sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)))
"""


@pytest.mark.procs
def test_connections_between_hosts_keep_large_socket_buffers(tmp_path: Path) -> None:
    with _Skipping(tmp_path, "unshaped") as lab:
        runs = lab.run(["-c", _BUFFERS], [0, 1],
                       lambda rank: [str(rank), ",".join(lab.addrs), str(tmp_path)],
                       lambda rank: {}, timeout=40)
    assert all(r.ok for r in runs), "\n".join(r.log for r in runs)
    for rank in (0, 1):
        assert int((tmp_path / f"rcvbuf{rank}").read_text()) >= 2 * (1 << 20), rank
