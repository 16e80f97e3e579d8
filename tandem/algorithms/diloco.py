"""DiLoCo (https://arxiv.org/abs/2311.08105): training across slow links by talking every H steps.

Each rank runs its own inner optimizer for ``sync_every`` (H) steps; then the ranks
average the *pseudo-gradient* (the outer parameters minus the local ones: how far each
rank moved since the last sync) and an outer optimizer applies that average to the
outer parameters, which are copied back into the model::

    diloco = DiLoCo(model, inner_optimizer,
                    outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9,
                                                               nesterov=True),
                    sync_every=H)
    for x, y in data:
        loss_fn(model(x), y).backward()
        inner_optimizer.step()
        inner_optimizer.zero_grad()
        diloco.step()               # counts inner steps; the outer step when due

Streaming (https://arxiv.org/abs/2501.18512, ``fragments > 1``): the parameters are
split into fragments of about equal size that sync in turn, evenly spread over the H
steps, and each exchange is started asynchronously and finished ``delay`` inner steps
later, so it travels while the next steps compute. When a delayed exchange lands, the
fragment becomes the new outer parameters plus the local progress made while it
travelled (with ``delay=0`` exactly the new outer parameters).

Compression of the exchange: ``"bf16"`` or ``"int8"`` (symmetric, one fp32 scale per
``block_size`` values). A compressed exchange is a reduce-scatter (an all-to-all of the
compressed chunks, summed in fp32 by the chunk's owner) and an all-gather of the
compressed averages, so every rank decodes the same bytes and the outer parameters stay
identical on all ranks. Uncompressed, it is one all-reduce, except where tandem would
all-reduce the payload by recursive doubling (below the ring's threshold, more than 2
ranks, ``delay`` not 1): doubling sends log2(W) payloads per rank, so the exchange is
then a reduce-scatter and an all-gather of fp32 chunks, 2 (W-1)/W payloads, as the ring
sends; streaming's small fragments thus cost the bytes of the whole model's exchange.

Hierarchical training: DDP inside a host (shared memory, every step), DiLoCo across
hosts. :func:`host_groups` gives this rank's host group and its cross-host group (the
ranks with its index on every host); with ``group=cross, host_group=host`` each rank of
a host carries one slice of the pseudo-gradient across hosts and the host all-gathers
the averaged slices over shared memory, so the host's link carries the model once::

    host, cross = host_groups(local_size)
    model = DistributedDataParallel(net, process_group=host)
    diloco = DiLoCo(net, opt, outer, sync_every=H, group=cross, host_group=host)
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import math
import threading
import time
from typing import Any, Callable

import torch
from torch import nn

from tandem.algorithms.model_averaging.averagers import check_count
from tandem.collectives.alltoall import all_to_all_single
from tandem.collectives.api import all_gather_into_tensor, all_reduce, broadcast
from tandem.collectives.group import NonMemberGroup, ProcessGroup
from tandem.collectives.reduce_op import ReduceOp
from tandem.collectives.work import Work
from tandem.collectives.world import AnyGroup, resolve_group
from tandem.config import at_most
from tandem.errors import ArgumentError, StateError

__all__ = ["DiLoCo", "host_groups"]

COMPRESSIONS = (None, "bf16", "int8")
_STATE_VERSION = 1


def _count(name: str, value: Any, least: int) -> int:
    return check_count("DiLoCo", name, value, least)


def _split(sizes: list[int], fragments: int) -> list[range]:
    """Consecutive parameter index ranges of about equal numel, each non-empty."""
    total = sum(sizes)
    bounds, start, done = [], 0, 0
    for f in range(fragments - 1):
        target = total * (f + 1) / fragments
        end = start + 1  # at least one parameter in this fragment
        done += sizes[start]
        # grow while it gets closer to the target and leaves one parameter per later fragment
        while (end < len(sizes) - (fragments - 1 - f)
               and abs(done + sizes[end] - target) <= abs(done - target)):
            done += sizes[end]
            end += 1
        bounds.append(range(start, end))
        start = end
    bounds.append(range(start, len(sizes)))
    return bounds


class _Codec:
    """Encodes a flat fp32 chunk into bytes and back: bf16, int8 with block scales, or
    "fp32" (the values as they are: an uncompressed exchange in two phases)."""

    def __init__(self, kind: str, block: int) -> None:
        self.kind, self.block = kind, block

    def nbytes(self, n: int) -> int:
        if self.kind == "fp32":
            return 4 * n
        if self.kind == "bf16":
            return 2 * n
        return n + 4 * (n // self.block)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "fp32":
            return x.contiguous().view(torch.uint8)
        if self.kind == "bf16":
            return x.to(torch.bfloat16).view(torch.uint8)
        blocks = x.view(-1, self.block)
        scale = blocks.abs().amax(dim=1) / 127.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(blocks / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        return torch.cat([q.view(torch.uint8).reshape(-1), scale.view(torch.uint8)])

    def decode(self, data: torch.Tensor, n: int) -> torch.Tensor:
        if self.kind == "fp32":
            return data.view(torch.float32)
        if self.kind == "bf16":
            return data.view(torch.bfloat16).to(torch.float32)
        q = data[:n].view(torch.int8).to(torch.float32).view(-1, self.block)
        scale = data[n:].clone().view(torch.float32)
        return (q * scale[:, None]).reshape(-1)


@dataclasses.dataclass
class _Exchange:
    """One fragment's outer exchange in flight."""

    fragment: int
    started: int          # inner step at which it started
    finish: int           # inner step at which it is finished
    start_local: torch.Tensor   # the fragment's local parameters when it started (flat)
    mine: torch.Tensor          # this rank's pseudo-gradient (flat, fp32)
    payload: torch.Tensor | None = None  # what crosses the group: mine, or this host rank's slice
    issued: bool = False
    world: int = 1
    result: torch.Tensor | None = None  # the averaged pseudo-gradient, once known
    work: Work | None = None
    codec: _Codec | None = None  # two phases (reduce-scatter, all-gather) when set
    stage: int = 0              # two phases: 1 = all-to-all in flight, 2 = all-gather
    recv: torch.Tensor | None = None
    gathered: torch.Tensor | None = None
    issued_at: float = 0.0
    issued_step: int = 0
    done_at: list[float] = dataclasses.field(default_factory=list)


class DiLoCo:
    """Outer steps every ``sync_every`` inner steps; see the module docstring.

    Every member of ``group`` must construct it: the first rank's parameters are
    broadcast to the others. Arguments: ``model`` (its parameters with ``requires_grad``
    are synchronised),
    ``inner_optimizer`` (the optimizer the caller steps), ``outer_optimizer`` (a callable
    building the outer optimizer from a list of tensors), ``sync_every`` (H, inner steps
    between a fragment's syncs), ``fragments`` (streaming when > 1), ``compression``
    (None, "bf16", "int8"), ``group`` (the group the outer exchange uses; None: the
    default group, looked up at each exchange, so it follows an elastic regroup),
    ``delay`` (inner steps between starting and finishing an exchange; default 0 without
    fragments, ``max(1, sync_every // fragments)`` with), ``block_size`` (values per int8
    scale), ``host_group`` (hierarchical: the ranks of this host, which hold the same
    parameters through DDP; each carries a slice across ``group``).

    Counters for benchmarks: ``bytes_sent`` (bytes this rank sent in outer exchanges,
    headers aside: for an all-reduce, those of the algorithm tandem picks; the
    reduce-scatter and all-gather send 2(W-1)/W of the payload), ``comm_seconds`` (from
    issuing each exchange's collective to its completion), ``exposed_seconds`` (of
    those, spent blocked waiting), and ``hidden_fraction`` (1 - exposed/comm).
    """

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer,
                 outer_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
                 sync_every: int, fragments: int = 1, compression: str | None = None,
                 group: AnyGroup | None = None, *, delay: int | None = None,
                 block_size: int = 256, host_group: AnyGroup | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise ArgumentError(f"DiLoCo: model must be an nn.Module, got "
                                f"{type(model).__name__}")
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise ArgumentError(f"DiLoCo: inner_optimizer must be a torch.optim.Optimizer, "
                                f"got {type(inner_optimizer).__name__}")
        if not callable(outer_optimizer) or isinstance(outer_optimizer, torch.optim.Optimizer):
            raise ArgumentError("DiLoCo: outer_optimizer must be a callable that builds the "
                                "outer optimizer from a list of tensors, e.g. lambda params: "
                                "torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)"
                                f"; got {type(outer_optimizer).__name__}")
        self.sync_every = _count("sync_every (inner steps between outer steps)", sync_every, 1)
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ArgumentError("DiLoCo: the model has no parameters with requires_grad")
        self.fragments = _count("fragments", fragments, 1)
        if self.fragments > len(self.params):
            raise ArgumentError(f"DiLoCo: fragments={self.fragments} is more than the model's "
                                f"{len(self.params)} trainable parameter tensors; a fragment "
                                f"holds whole tensors, so use at most {len(self.params)}")
        if compression not in COMPRESSIONS:
            raise ArgumentError(f"DiLoCo: compression must be one of None, 'bf16', 'int8', "
                                f"got {compression!r}")
        self.compression = compression
        self.block_size = _count("block_size", block_size, 1)
        values = sum(p.numel() for p in self.params)
        at_most("DiLoCo: block_size", self.block_size, max(values, 256),
                f"a block longer than the model's {values} trainable values only adds padding",
                "use the default 256 or a smaller block")
        if delay is None:
            delay = 0 if self.fragments == 1 else max(1, self.sync_every // self.fragments)
        self.delay = _count("delay", delay, 0)
        if self.delay > self.sync_every:
            raise ArgumentError(f"DiLoCo: delay={self.delay} is more than sync_every="
                                f"{self.sync_every}: an exchange must finish before its "
                                f"fragment syncs again; use delay <= {self.sync_every}")
        if any(p.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16)
               for p in self.params):
            raise ArgumentError("DiLoCo: every trainable parameter must be floating point")
        for p in self.params:
            if p.device.type != "cpu":
                raise ArgumentError(f"DiLoCo: parameters must be on the CPU (tandem's "
                                    f"collectives are), got one on {p.device}")
        self.group = group
        if host_group is not None and not isinstance(host_group, (ProcessGroup, NonMemberGroup)):
            raise ArgumentError(f"DiLoCo: host_group must be a process group (the ranks of this "
                                f"host, see host_groups), got {type(host_group).__name__}")
        self.host_group = host_group
        self._check_hierarchy()
        self.inner_optimizer = inner_optimizer
        self._codec = None if compression is None else _Codec(compression, self.block_size)
        self._frags = _split([p.numel() for p in self.params], self.fragments)
        # offsets spread the fragments' syncs evenly over the H steps; fragment F-1 syncs at
        # multiples of H, as plain DiLoCo does
        self._offsets = [((f + 1) * self.sync_every // self.fragments) % self.sync_every
                         for f in range(self.fragments)]
        self._start_equal()
        self.outer_params = [p.detach().clone().to(torch.float32) for p in self.params]
        self.outer_optimizer = outer_optimizer(self.outer_params)
        if not isinstance(self.outer_optimizer, torch.optim.Optimizer):
            raise ArgumentError(f"DiLoCo: outer_optimizer(params) must return a "
                                f"torch.optim.Optimizer, got "
                                f"{type(self.outer_optimizer).__name__}")
        self.inner_steps = 0
        self.outer_steps = 0  # fragment syncs finished
        self.bytes_sent = 0
        self.comm_seconds = 0.0
        self.exposed_seconds = 0.0
        self._pending: list[_Exchange] = []
        self._lock = threading.Lock()

    def _check_hierarchy(self) -> None:
        """With a host group, ``group`` must hold this rank and no other of its host: the
        slices of one index travel together."""
        host = self._host()
        if host is None:
            return
        cross = self._group()
        if self.group is None or cross is None:
            raise ArgumentError("DiLoCo: host_group needs group= the cross-host group of this "
                                "rank's index (host_groups(local_size) gives both)")
        shared = sorted(set(host.ranks) & set(cross.ranks))
        if len(shared) != 1:
            raise ArgumentError(f"DiLoCo: group and host_group share the ranks {shared}; the "
                                f"cross-host group must hold one rank per host (host_groups"
                                f"(local_size) gives both)")

    def _start_equal(self) -> None:
        """Every rank starts from the first rank's parameters (as DDP does): outer
        parameters that began apart would stay apart. Ranks that already agree (built from
        one seed, as training scripts do) skip the broadcast: a digest's all-reduce tells,
        16 bytes where the broadcast sends the model to every rank."""
        g = self._group()
        if g is None or g.group_size == 1:
            return
        digest = hashlib.blake2b(digest_size=7)  # 56 bits: the negation fits an int64
        for p in self.params:
            t = p.detach().contiguous()
            digest.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))
        mine = int.from_bytes(digest.digest(), "little")
        spread = torch.tensor([mine, -mine], dtype=torch.int64)
        all_reduce(spread, op=ReduceOp.MAX, group=g)
        if int(spread[0]) == -int(spread[1]):  # the largest digest is the smallest: all equal
            return
        flat = torch.cat([p.detach().reshape(-1).to(torch.float32) for p in self.params])
        broadcast(flat, group=g, group_src=0)
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()

    # -- the training loop's call ---------------------------------------------------------
    def step(self) -> None:
        """Count one inner step; start, advance or finish the exchanges that are due."""
        self.inner_steps += 1
        t = self.inner_steps
        for ex in self._pending:  # loaded from a state dict: started again on this group
            if not ex.issued:
                self._issue(ex)
        for ex in list(self._pending):
            if ex.finish == t:
                self._finish(ex)
            elif ex.codec is not None and ex.stage == 1 and t == ex.started + self.delay // 2:
                self._second_phase(ex)
        for f, offset in enumerate(self._offsets):
            if t % self.sync_every == offset:
                self._start(f)

    @property
    def hidden_fraction(self) -> float:
        """The share of the exchanges' time that overlapped inner steps (0 when none ran)."""
        if self.comm_seconds <= 0:
            return 0.0
        return max(0.0, 1.0 - self.exposed_seconds / self.comm_seconds)

    def sync(self) -> None:
        """Finish the exchanges in flight now (every rank must call it at the same step)."""
        for ex in list(self._pending):
            if not ex.issued:
                self._issue(ex)
            self._finish(ex)

    # -- one exchange -----------------------------------------------------------------------
    def _group(self) -> ProcessGroup | None:
        if isinstance(self.group, NonMemberGroup):
            return None
        return resolve_group(self.group, "DiLoCo")

    def _flat_local(self, f: int) -> torch.Tensor:
        return torch.cat([self.params[i].detach().reshape(-1).to(torch.float32)
                          for i in self._frags[f]])

    def _flat_outer(self, f: int) -> torch.Tensor:
        return torch.cat([self.outer_params[i].reshape(-1) for i in self._frags[f]])

    def _start(self, f: int) -> None:
        if any(ex.fragment == f for ex in self._pending):
            raise StateError(f"DiLoCo: fragment {f} syncs again while its last exchange is in "
                             f"flight")  # ruled out by delay <= sync_every
        local = self._flat_local(f)
        ex = _Exchange(fragment=f, started=self.inner_steps,
                       finish=self.inner_steps + self.delay, start_local=local,
                       mine=self._flat_outer(f) - local)
        self._pending.append(ex)
        self._issue(ex)
        if self.delay == 0:
            self._finish(ex)

    def _host(self) -> ProcessGroup | None:
        if self.host_group is None or isinstance(self.host_group, NonMemberGroup):
            return None
        host = resolve_group(self.host_group, "DiLoCo")
        return host if host.group_size > 1 else None

    def _issue(self, ex: _Exchange) -> None:
        """Start the exchange's first collective (asynchronously)."""
        ex.issued = True
        host = self._host()
        payload = ex.mine
        if host is not None:  # each rank of the host carries one slice across hosts
            size = math.ceil(ex.mine.numel() / host.group_size)
            lo = min(host.rank() * size, ex.mine.numel())
            payload = torch.zeros(size)
            part = ex.mine[lo:lo + size]
            payload[:part.numel()] = part
        ex.payload = payload
        g = self._group()
        if g is None:  # not a member: nothing to average with
            ex.result = payload.clone()
            return
        w = ex.world = g.group_size
        ex.codec = self._codec
        if ex.codec is None:
            buf = payload / w  # divided before summing: no overflow, the same rounding as DDP
            # with delay 1 the second phase could only start at the finishing step, in full
            # view; one all-reduce then travels hidden behind the step
            if self.delay == 1 or not _doubling_costs_more(g, buf):
                ex.result = buf
                self.bytes_sent += _all_reduce_bytes(g, buf)
                ex.work = self._launch(ex, lambda: all_reduce(buf, op=ReduceOp.SUM, group=g,
                                                              async_op=True))
                return
            # a fragment below the ring's threshold would go by recursive doubling, which
            # sends it log2(W) times; a reduce-scatter and an all-gather send 2 (W-1)/W
            ex.codec = _Codec("fp32", 1)
            payload = buf
        per = self._unit() * w
        padded = torch.zeros(math.ceil(payload.numel() / per) * per)
        padded[:payload.numel()] = payload
        chunk = padded.numel() // w
        send = torch.cat([ex.codec.encode(c) for c in padded.split(chunk)])
        ex.recv = torch.empty_like(send)
        self.bytes_sent += send.numel() * (w - 1) // w
        ex.stage = 1
        recv = ex.recv
        ex.work = self._launch(ex, lambda: all_to_all_single(recv, send, group=g,
                                                             async_op=True))

    def _launch(self, ex: _Exchange, issue: Callable[[], Work | None]) -> Work:
        ex.done_at = []
        ex.issued_at = time.perf_counter()
        ex.issued_step = self.inner_steps
        work = issue()
        assert work is not None
        stamps = ex.done_at
        work.get_future().add_done_callback(lambda _: stamps.append(time.perf_counter()))
        return work

    def _wait(self, ex: _Exchange) -> None:
        """Wait for the exchange's collective; count its time and the time blocked."""
        work = ex.work
        if work is None:
            return
        # issued in this same step: no inner step ran meanwhile, so all of it was exposed
        began = ex.issued_at if ex.issued_step == self.inner_steps else time.perf_counter()
        if not work.is_completed():
            work.wait()
        # the completion stamp comes from the futures thread; it is set before wait returns
        end = ex.done_at[0] if ex.done_at else time.perf_counter()
        blocked = max(0.0, end - began)
        with self._lock:
            self.comm_seconds += max(0.0, end - ex.issued_at)
            self.exposed_seconds += blocked
        ex.work = None

    def _second_phase(self, ex: _Exchange) -> None:
        """Two phases: sum the chunk this rank owns, start the all-gather of the averages."""
        codec = ex.codec
        assert codec is not None and ex.recv is not None
        self._wait(ex)
        g = self._group()
        assert g is not None
        w = ex.world
        rows = ex.recv.view(w, -1)
        row_bytes = rows.shape[1]
        chunk = self._chunk_len(ex)
        total = torch.zeros(chunk)
        for r in range(w):  # fp32 sums in rank order: the same on every rank for a chunk
            total += codec.decode(rows[r], chunk)
        # fp32: each part was divided by W before the exchange, as the all-reduce does
        mine = codec.encode(total if codec.kind == "fp32" else total / w)
        ex.gathered = torch.empty(w * row_bytes, dtype=torch.uint8)
        self.bytes_sent += (w - 1) * row_bytes
        ex.stage = 2
        gathered = ex.gathered
        ex.work = self._launch(ex, lambda: all_gather_into_tensor(gathered, mine, group=g,
                                                                  async_op=True))

    def _chunk_len(self, ex: _Exchange) -> int:
        per = self._unit() * ex.world
        assert ex.payload is not None
        return math.ceil(ex.payload.numel() / per) * self._unit()

    def _unit(self) -> int:
        """Chunks are whole int8 blocks; bf16 needs no alignment."""
        return self.block_size if self.compression == "int8" else 1

    def _finish(self, ex: _Exchange) -> None:
        """Average known: the outer step on the fragment, and the model's fragment updated."""
        codec = ex.codec
        if codec is not None and ex.stage == 1:
            self._second_phase(ex)
        self._wait(ex)
        if codec is not None and ex.gathered is not None:
            assert ex.payload is not None
            chunk = self._chunk_len(ex)
            rows = ex.gathered.view(ex.world, -1)
            ex.result = torch.cat([codec.decode(rows[r], chunk)
                                   for r in range(ex.world)])[:ex.payload.numel()]
        assert ex.result is not None
        host = self._host()
        if host is not None:  # the host's slices, over shared memory
            whole = torch.empty(ex.result.numel() * host.group_size)
            all_gather_into_tensor(whole, ex.result.contiguous(), group=host)
            ex.result = whole[:ex.mine.numel()]
        self._pending.remove(ex)
        self._outer_step(ex)

    def _outer_step(self, ex: _Exchange) -> None:
        members = self._frags[ex.fragment]
        result = ex.result
        assert result is not None
        for outer in self.outer_params:  # the other fragments' outer parameters stay put
            outer.grad = None
        offset = 0
        for i in members:
            n = self.outer_params[i].numel()
            self.outer_params[i].grad = result[offset:offset + n].view_as(
                self.outer_params[i]).clone()
            offset += n
        self.outer_optimizer.step()
        for i in members:
            self.outer_params[i].grad = None
        offset = 0
        with torch.no_grad():
            for i in members:
                p, outer = self.params[i], self.outer_params[i]
                n = p.numel()
                if self.delay == 0:
                    p.copy_(outer)
                else:  # keep the local progress made while the exchange travelled
                    moved = p.detach().reshape(-1).to(torch.float32) - \
                        ex.start_local[offset:offset + n]
                    p.copy_((outer.reshape(-1) + moved).view_as(p))
                offset += n
        self.outer_steps += 1

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The outer parameters, the outer optimizer's state, the counters and the
        exchanges in flight (this rank's part: ``load_state_dict`` starts them again)."""
        return {
            "version": _STATE_VERSION,
            "sync_every": self.sync_every, "fragments": self.fragments,
            "compression": self.compression, "delay": self.delay,
            "inner_steps": self.inner_steps, "outer_steps": self.outer_steps,
            "outer_params": [p.clone() for p in self.outer_params],
            "outer_optimizer": self.outer_optimizer.state_dict(),
            "pending": [{"fragment": ex.fragment, "started": ex.started,
                         "start_local": ex.start_local.clone(), "mine": ex.mine.clone()}
                        for ex in self._pending],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`. Exchanges in flight are dropped; those of
        ``state`` start again at the next :meth:`step`, on the group current then (so
        loading issues no collective: an elastic restore may run it at any point)."""
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise ArgumentError(f"DiLoCo.load_state_dict: not a DiLoCo state dict of version "
                                f"{_STATE_VERSION} (keys: {sorted(state) if isinstance(state, dict) else type(state).__name__})")
        for key in ("sync_every", "fragments", "compression", "delay"):
            if state[key] != getattr(self, key):
                raise ArgumentError(f"DiLoCo.load_state_dict: the state has {key}="
                                    f"{state[key]!r}, this DiLoCo {key}={getattr(self, key)!r}; "
                                    f"build it with the same settings")
        saved = state["outer_params"]
        if len(saved) != len(self.outer_params) or any(
                a.shape != b.shape for a, b in zip(saved, self.outer_params)):
            raise ArgumentError("DiLoCo.load_state_dict: the saved outer parameters do not "
                                "match the model's trainable parameters (count or shapes)")
        for ex in self._pending:  # abandoned: a rolled-back group will not finish them
            ex.work = None
        self._pending = []
        with torch.no_grad():
            for p, s in zip(self.outer_params, saved):
                p.copy_(s)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self.inner_steps = int(state["inner_steps"])
        self.outer_steps = int(state["outer_steps"])
        for item in state["pending"]:
            ex = _Exchange(fragment=int(item["fragment"]), started=int(item["started"]),
                           finish=int(item["started"]) + self.delay,
                           start_local=item["start_local"].clone(), mine=item["mine"].clone())
            self._pending.append(ex)  # started again at the next step() or sync()


def _doubling_costs_more(g: ProcessGroup, buf: torch.Tensor) -> bool:
    """Whether tandem would all-reduce ``buf`` over ``g`` by recursive doubling, which
    sends more than a reduce-scatter and all-gather do once there are more than 2 ranks
    (log2(W) payloads against 2 (W-1)/W); shared memory and the hierarchical algorithm
    choose for themselves."""
    from tandem.collectives.algorithms import select_all_reduce

    return g.group_size > 2 and select_all_reduce(g, buf)[0] == "doubling"


def _all_reduce_bytes(g: ProcessGroup, buf: torch.Tensor) -> int:
    """The bytes this rank sends in an all-reduce of ``buf`` over ``g``, by the algorithm
    tandem picks for it: recursive doubling (small payloads) exactly; otherwise the ring's
    2 (W-1)/W of the payload, the bandwidth-optimal volume."""
    from tandem.collectives.algorithms import select_all_reduce

    w, n = g.group_size, buf.numel() * buf.element_size()
    name, _ = select_all_reduce(g, buf)
    if name == "doubling":
        pow2 = 1 << (w.bit_length() - 1)
        r = g.group_rank
        if r >= pow2:  # folded: hands its buffer to a partner, gets the result back
            return n
        return (pow2.bit_length() - 1) * n + (n if r < w - pow2 else 0)
    return 2 * (w - 1) * n // w


def host_groups(local_size: int, group: AnyGroup | None = None
                ) -> tuple[AnyGroup | None, AnyGroup | None]:
    """(this rank's host group, this rank's cross-host group) for hierarchical DiLoCo.

    Ranks ``h*local_size .. h*local_size+local_size-1`` of ``group`` form host ``h`` (as
    launchers number them); the cross-host groups join the ranks with the same index on
    each host. Every member of ``group`` must call it (it creates subgroups).
    """
    from tandem.collectives.subgroups import new_subgroups, new_subgroups_by_enumeration
    from tandem.collectives.world import get_world_size

    size = get_world_size(group)
    local_size = check_count("host_groups", "local_size", local_size, 1)
    if size % local_size:
        raise ArgumentError(f"host_groups: local_size={local_size} does not divide the group's "
                            f"{size} ranks")
    host, _ = new_subgroups(group_size=local_size, group=group)
    base = resolve_group(group, "host_groups")
    ranks = base.ranks
    cross, _ = new_subgroups_by_enumeration(
        [[ranks[h * local_size + i] for h in range(size // local_size)]
         for i in range(local_size)])
    return host, cross
