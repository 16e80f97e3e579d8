"""Large received tensors live on recycled mappings: reused only once the user's tensor
(and every view of it) is freed, bounded, and correct through the codec."""

from __future__ import annotations

import gc

import pytest
import torch

from tandem.rpc import _buffers, _codec
from tandem.rpc._buffers import LARGE, ReceiveBuffers
from tandem.transport.base import Header, Kind

pytestmark = pytest.mark.timeout(60)


def test_small_tensors_come_from_torch_and_large_ones_from_a_mapping() -> None:
    pool = ReceiveBuffers()
    small = pool.empty((4,), torch.float32)
    big = pool.empty((3, LARGE // 4), torch.float32)
    assert small.shape == (4,) and big.shape == (3, LARGE // 4)
    assert big.dtype == torch.float32 and big.is_contiguous()
    assert big.data_ptr() % (2 << 20) == 0  # aligned for huge pages
    big.fill_(2.5)
    assert big.sum().item() == 2.5 * big.numel()
    del small, big
    assert pool.cached() == 1
    pool.close()


def test_memory_is_reused_only_after_every_view_is_freed() -> None:
    pool = ReceiveBuffers()
    first = pool.empty((LARGE,), torch.uint8)
    ptr = first.data_ptr()
    view = first[10:20]
    del first
    second = pool.empty((LARGE,), torch.uint8)
    assert second.data_ptr() != ptr, "memory handed out again while a view of it lived"
    view.fill_(7)
    assert pool.cached() == 0
    del view
    gc.collect()
    assert pool.cached() == 1
    third = pool.empty((LARGE,), torch.uint8)
    assert third.data_ptr() == ptr
    del second, third
    pool.close()


def test_the_cache_is_bounded_and_close_empties_it() -> None:
    pool = ReceiveBuffers()
    many = [pool.empty((LARGE,), torch.uint8) for _ in range(_buffers._CACHED + 5)]
    del many
    assert pool.cached() == _buffers._CACHED
    pool.close()
    assert pool.cached() == 0
    late = pool.empty((LARGE,), torch.uint8)  # still works after close, caches nothing
    late.fill_(1)
    del late
    assert pool.cached() == 0


def test_a_large_message_decodes_equal_onto_recycled_memory() -> None:
    pool = ReceiveBuffers()
    for trip in range(3):
        x = torch.randn(LARGE // 2, dtype=torch.float64) + trip
        out = _codec.encode({"x": x, "y": torch.arange(5)}, "x")
        header = Header(Kind.RPC, out.meta_bytes, 1, 0, out.nbytes)
        message = _codec.read_message(header, _codec.local_reader(out.parts), "me", pool.empty)
        back = _codec.decode(message)
        assert torch.equal(back["x"], x) and torch.equal(back["y"], torch.arange(5))
        del back, message
    assert pool.cached() == 1
    pool.close()
