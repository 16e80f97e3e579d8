"""All-reduce of large tensors straight between the members' tensors, no staging copy.

The staging path (``shm``) copies every byte of a tensor into shared memory and reads
it back out, and every member waits for every other at each of its rounds. When the
kernel lets the members read and write each other's memory (cross-memory attach,
``Arena.read_member`` and ``write_member``), member ``me`` of ``p`` instead owns one slice of the
tensor (``even_bounds``) and, an L2-sized chunk at a time:

    1. reads the chunk of every peer's tensor into a private scratch (one syscall each),
    2. combines all ``p`` contributions in member order into its own tensor,
    3. writes the result into every peer's tensor at the same place.

Per member that is its tensor read once and written once (its own slice in place,
the peers' slices by the kernel copy), the bytes the memory-bandwidth bound counts,
and no wait between the call's start and its end: a member descheduled on a busy
host delays only the end. Nobody else touches a member's slice of anyone's tensor,
so no ordering is needed inside the call; the members wait for each other twice:
after publishing where their tensors are (also the mismatch check), and before
returning (every peer finished writing into this member's tensor).

Results are bit-identical on every member and equal to the naive algorithm's: each
slice is combined in member order by one member and copied to the others.

The first call that could go this way also agrees on whether it may: each member
probes that it may read and write every peer (``Arena.probe_direct``), publishes the
verdict and waits once more; if any member may not, that call and every later one
take the staging path. ``MIN_BYTES`` keeps small tensors on the staging path, whose
rounds cost no system call, and ``MIN_MEMBERS`` pairs of ranks (see there).
"""

from __future__ import annotations

import errno
from typing import Callable

import torch

from tandem.collectives.algorithms.ring import even_bounds
from tandem.collectives.algorithms.shm_checks import verify
from tandem.collectives.group import Op
from tandem.collectives.reduce_op import ReduceOp, combiner, finish
from tandem.errors import PeerLostError, ProtocolError
from tandem.transport import Arena

__all__ = ["MIN_BYTES", "MIN_MEMBERS", "CHUNK_BYTES", "direct_applies", "direct_all_reduce"]

# below this the staging path's rounds cost less than the system calls (2 ranks,
# per call: 128 KB 0.07 ms staged vs 0.08 direct; 512 KB 0.16 vs 0.12; 1 MB 0.25 vs 0.17)
MIN_BYTES = 256 << 10
# chunks of a 32 MB slice, one rank alone (read, combine, write back): 13.5 ms at 256 KB,
# 14.6 ms at 512 KB, 14.4 ms at 128 KB, 17.3 ms at 1 MB (a 64 MB copy: 10.7 ms)
CHUNK_BYTES = 256 << 10
# two members keep the staging path (whole rounds): it is less work per rank (the
# staging copy stays in cache and costs less than a cross-memory read, which pins the
# peer's pages). Measured, 64 MB, share of the copy bound, 9 alternated runs each:
# staging median 77% (35-81%), direct 72% (69-77%): direct only wins when other jobs
# take the cores (load 38-43: 69-73% against 35-73%). From three members on, direct
# moves about a third of the staging path's bytes (4 ranks on 2 cores: 25% against 20%).
MIN_MEMBERS = 3


def direct_applies(arena: Arena, tensors: list[torch.Tensor]) -> bool:
    """Whether a call on ``tensors`` may take this path; the same answer on every member
    (it depends only on the call's signature and on the members' agreed verdict)."""
    if (len(tensors) != 1 or arena.size < MIN_MEMBERS or arena.direct is False
            or not arena.direct_possible()):
        return False
    t = tensors[0]
    return t.numel() * t.element_size() >= MIN_BYTES and t.is_contiguous()


def direct_all_reduce(op: Op, arena: Arena, check: Callable[[], None], buf: torch.Tensor,
                      redop: ReduceOp) -> bool:
    """All-reduce contiguous ``buf`` in place (see the module doc).

    Returns False, with nothing changed, if the members found they may not reach each
    other's memory; every member then returns False from the same call.
    """
    arena.publish_buffer(buf.data_ptr())
    arena.post()
    arena.wait_all(arena.posted, check)
    verify(op, arena)
    if arena.direct is None:
        arena.probe_direct()
        arena.post()
        arena.wait_all(arena.posted, check)
        arena.direct = all(arena.verdict(q) for q in range(arena.size))
    if not arena.direct:
        return False
    _reduce_my_slice(op, arena, buf, redop)
    arena.post()  # after my last write into a peer's tensor
    arena.wait_all(arena.posted, check)  # every peer is done with mine
    return True


def _reduce_my_slice(op: Op, arena: Arena, buf: torch.Tensor, redop: ReduceOp) -> None:
    p, me, size = arena.size, arena.index, buf.element_size()
    kernel = combiner(redop, buf.dtype)
    per = max(1, CHUNK_BYTES // size)
    peers = [q for q in range(p) if q != me]
    where = {q: arena.buffer_of(q) for q in peers}
    room = arena.scratch(per * size * (p - 1)).view(buf.dtype)
    scratch = {q: room[i * per:(i + 1) * per] for i, q in enumerate(peers)}
    lo, hi = even_bounds(buf.numel(), p)[me]
    for a in range(lo, hi, per):
        k = min(per, hi - a)
        x = buf[a:a + k]
        parts = [x if q == me else scratch[q][:k] for q in range(p)]
        for q in peers:
            _move(op, arena, q, where[q] + a * size, parts[q].data_ptr(), k * size, read=True)
        # fold in member order; the running value goes into x once x itself is folded
        # in, before that into member 0's scratch (member 0 is a peer then)
        acc = parts[0]
        for j in range(1, p):
            out = x if j >= me else parts[0]
            kernel(acc, parts[j], out)
            acc = out
        finish(redop, x, p)
        for q in peers:
            _move(op, arena, q, where[q] + a * size, x.data_ptr(), k * size, read=False)


def _move(op: Op, arena: Arena, member: int, address: int, local: int, nbytes: int,
          read: bool) -> None:
    """Read ``nbytes`` at ``address`` of ``member``'s process into ``local``, or write
    them there; a failure names the member."""
    try:
        if read:
            arena.read_member(member, address, local, nbytes)
        else:
            arena.write_member(member, address, local, nbytes)
    except OSError as exc:
        g = op.group
        rank = g.ranks[member]
        lost = g.transport.lost(rank)
        if lost is not None or exc.errno == errno.ESRCH:
            raise PeerLostError(f"{op.describe()} failed: rank {rank}'s process is gone"
                                f"{f' ({lost})' if lost else ''}", rank) from exc
        raise ProtocolError(f"{op.describe()} failed: cannot {'read' if read else 'write'} "
                            f"the tensor of rank {rank}: {exc}") from exc
