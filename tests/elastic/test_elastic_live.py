"""The live checkpoint: a snapshot travels whole and checked, or is refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import tandem
from tandem.elastic._live import pack, recv_snapshot, send_snapshot, unpack
from tandem.elastic._snapshot import Snapshot, capture
from tandem.errors import ProtocolError
from tandem.testing import launch

LIMIT = 1 << 30


def _snapshot() -> Snapshot:
    torch.manual_seed(0)
    net = torch.nn.Linear(64, 32)
    opt = torch.optim.AdamW(net.parameters())
    net(torch.randn(4, 64)).sum().backward()
    opt.step()
    return capture(5, net, opt, {"step": 12, "history": [(0, 2, 0.5)]}, [48])


def test_an_intact_snapshot_comes_back_equal() -> None:
    snap = _snapshot()
    got = unpack(*pack(snap), sender=0, limit=LIMIT)
    assert got.commit == 5 and got.values == snap.values and got.positions == [48]
    for name, t in snap.model.items():
        assert torch.equal(got.model[name], t)
    assert torch.equal(got.optimizer["state"][0]["exp_avg"], snap.optimizer["state"][0]["exp_avg"])


def test_a_truncated_payload_is_refused() -> None:
    header, payload = pack(_snapshot())
    with pytest.raises(ProtocolError, match="truncated or padded.*refused"):
        unpack(header, payload[:-100], sender=3, limit=LIMIT)


def test_a_corrupted_payload_is_refused() -> None:
    header, payload = pack(_snapshot())
    bad = bytearray(payload)
    bad[len(bad) // 2] ^= 0x40
    with pytest.raises(ProtocolError, match="rank 3: its .* bytes do not match the digest"):
        unpack(header, bytes(bad), sender=3, limit=LIMIT)


def test_a_header_that_is_not_one_or_too_large_is_refused() -> None:
    header, payload = pack(_snapshot())
    with pytest.raises(ProtocolError, match="not a tandem live checkpoint"):
        unpack(b"X" * len(header), payload, sender=1, limit=LIMIT)
    with pytest.raises(ProtocolError, match="the cap is 1000"):
        unpack(header, payload, sender=1, limit=1000)


def _tampered(rank: int, world_size: int, how: str) -> Any:
    g = tandem.collectives.world.default_group()
    if rank == 0:
        header, payload = pack(_snapshot())
        if how == "truncate":
            payload = payload[:-1000]
        elif how == "corrupt":
            payload = payload[:10] + bytes([payload[10] ^ 1]) + payload[11:]
        send_snapshot(g, 1, header, payload)
        return None
    try:
        return ("accepted", recv_snapshot(g, 0, LIMIT).commit)
    except ProtocolError as exc:
        return ("refused", str(exc))


@pytest.mark.smoke("tandem.elastic")
@pytest.mark.procs
@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["intact", "truncate", "corrupt"])
def test_a_tampered_transfer_over_the_transport_is_refused(how: str) -> None:
    outcomes = launch(2, _tampered, (how,), backend="tcp", timeout=60)
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
    verdict, detail = outcomes[1].value
    if how == "intact":
        assert (verdict, detail) == ("accepted", 5)
    elif how == "truncate":
        assert verdict == "refused" and "does not have the" in detail, detail
    else:
        assert verdict == "refused" and "do not match the digest" in detail, detail
