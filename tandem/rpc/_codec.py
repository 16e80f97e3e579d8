"""RPC messages on the wire: a pickled structure with tensors travelling beside it.

One message is one transport frame (``Kind.RPC``) whose payload is::

    table    ctx id (u64), autograd message id (u64), tensor count (u32), flags (u8: RRefs
             inside), then per tensor:
             dtype code (u8), flags (u8: requires grad, is a Parameter), ndim (u8), shape
    pickle   the structure; each tensor in it is a reference to its index in the table
    tensors  each tensor's raw bytes, in table order

The header's ``group`` field carries ``len(table) + len(pickle)``, so the receiver reads
those in one go, allocates every tensor with its final shape and dtype, and reads the
bytes straight into them: tensor bytes are never pickled, and the sender hands the
transport views of the tensors' own memory (a non-contiguous tensor is made contiguous
first). Tensors of other layouts or dtypes (sparse, quantized) fall back to torch's own
pickling; tensors on an accelerator are refused.

Functions travel by reference (module and qualified name), as pickle does; a lambda or
a nested function has no importable name, so it is refused with a message saying so.
RRefs are reduced through a callback that does the fork bookkeeping (``_rrefs``).
Nothing here is unpickled unless the transport authenticated the peer.
"""

from __future__ import annotations

import ctypes
import io
import math
import pickle
import struct
import threading
import types
from typing import Any, Callable

import torch

from tandem.collectives.group import as_bytes
from tandem.errors import ArgumentError, ProtocolError, StateError
from tandem.transport.base import Header, Reader

__all__ = ["Outgoing", "Incoming", "encode", "read_message", "decode", "local_reader",
           "CALL", "REMOTE", "REPLY", "ERROR", "NOTE"]

# message types, in the header's ``step`` (see ``_agent``)
CALL, REMOTE, REPLY, ERROR, NOTE = 0, 1, 2, 3, 4

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
           torch.complex128]
_CODE = {d: i for i, d in enumerate(_DTYPES)}
_HEAD = struct.Struct("<QQIB")  # ctx id, autograd message id, tensor count, flags
_TENSOR = struct.Struct("<BBB")
_SHAPES = [struct.Struct(f"<{n}q") for n in range(256)]
_GRAD, _PARAM = 1, 2  # per tensor
_RREFS = 1  # per message: the pickle refers to RRefs
_DRAIN = 1 << 20
# Messages up to this size are read in one go and their tensors copied out of it, and
# tensors up to it are copied into the message instead of being sent as views of their
# memory. Measured (timeit, one process): a 16-float tensor cost ~6 us to view and ~12 us
# to allocate and read into, against ~1.5 us and ~3 us copied.
_SMALL = 64 << 10
_REUSE_PICKLER = 2048  # a thread's pickler is replaced after a pickle larger than this


class _Decoding(threading.local):
    """The message this thread is unpickling (:func:`decode`)."""

    tensors: list[torch.Tensor] | None = None
    build_rref: Callable[..., Any] | None = None


_decoding = _Decoding()


# The pickle names these two functions as globals; the C unpickler finds them without a
# Python ``find_class`` and they look the message up in ``_decoding``. Measured: decoding
# a call with one tensor took ~11 us through an Unpickler subclass, ~3 us this way.
def _tensor_ref(index: int) -> Any:
    """Stands for tensor ``index`` of a message; decoding substitutes the tensor."""
    tensors = _decoding.tensors
    if tensors is None:
        raise StateError("a tandem RPC tensor reference can only be decoded by tandem's RPC")
    return tensors[index]


def _rref_ref(*fields: Any) -> Any:
    """Stands for an RRef in a message; decoding builds it (``build_rref``)."""
    build = _decoding.build_rref
    if build is None:
        raise StateError("an RRef can only be received through tandem's RPC")
    return build(*fields)


def _payload(t: torch.Tensor) -> memoryview:
    """The bytes of ``t`` to send (copies only a non-contiguous or lazily conjugated one)."""
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    return as_bytes(t)


class Outgoing:
    """An encoded message: ``parts`` go to ``Transport.isendv`` in order."""

    __slots__ = ("parts", "meta_bytes", "nbytes", "rrefs")

    def __init__(self, parts: list[memoryview], meta_bytes: int, nbytes: int,
                 rrefs: list[tuple[Any, Any]]) -> None:
        self.parts = parts
        self.meta_bytes = meta_bytes
        self.nbytes = nbytes
        self.rrefs = rrefs  # (RRef, fork id) for every RRef in the message


class _Pickler(pickle.Pickler):
    def __init__(self) -> None:
        self.buf = io.BytesIO()
        super().__init__(self.buf, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self.rrefs: list[tuple[Any, Any]] = []
        self._fork: Callable[[Any], tuple[Any, ...]] | None = None
        self.busy = False

    def run(self, obj: Any, fork: Callable[[Any], tuple[Any, ...]] | None
            ) -> tuple[bytes, list[torch.Tensor], list[tuple[Any, Any]]]:
        """Pickle ``obj``: the bytes, and the tensors and RRefs it referred to. Nothing of
        ``obj`` stays referenced here afterwards (an RRef kept alive would never be freed)."""
        self._fork, self.busy = fork, True
        try:
            self.dump(obj)
            return self.buf.getvalue(), self.tensors, self.rrefs
        finally:
            self.clear_memo()
            self.buf.seek(0)
            self.buf.truncate()
            self.tensors, self.rrefs, self._fork, self.busy = [], [], None, False

    def reducer_override(self, obj: Any) -> Any:  # noqa: C901 - one dispatch on type
        cls = type(obj)
        if cls is torch.Tensor or cls is torch.nn.Parameter:
            cpu = obj.is_cpu  # (``device.type`` builds a device object: ~1 us)
            if not cpu and not obj.is_meta:
                raise ArgumentError(f"cannot send a tensor on {obj.device}: tandem's RPC "
                                    f"moves CPU tensors; call .cpu() first")
            if cpu and obj.layout is torch.strided and obj.dtype in _CODE:
                self.tensors.append(obj)
                return _tensor_ref, (len(self.tensors) - 1,)
            return NotImplemented
        if cls is types.FunctionType and ("<lambda>" in obj.__qualname__
                                          or "<locals>" in obj.__qualname__):
            raise ArgumentError(
                f"cannot send function {obj.__qualname__!r} (module {obj.__module__}): "
                f"functions travel by reference and a lambda or a function defined inside "
                f"another function has no importable name; define it at module level")
        if self._fork is not None and getattr(cls, "_tandem_rref", False):
            fields = self._fork(obj)
            self.rrefs.append((obj, fields[2]))
            return _rref_ref, fields
        return NotImplemented


class _Cache(threading.local):
    pickler: _Pickler | None = None


_cache = _Cache()  # one pickler per thread, reused: making one costs more than the pickling


def _pickler() -> _Pickler:
    p = _cache.pickler
    if p is None:
        p = _cache.pickler = _Pickler()
    elif p.busy:  # pickling an argument sent something itself
        return _Pickler()
    return p


def encode(obj: Any, what: str, fork: Callable[[Any], tuple[Any, ...]] | None = None,
           ctx_id: int = 0, record: Callable[[list[torch.Tensor]], int] | None = None) -> Outgoing:
    """Encode ``obj``; ``what`` names it in errors. With ``ctx_id`` set (distributed
    autograd), ``record(tensors requiring grad) -> message id`` records the send."""
    pickler = _pickler()
    try:
        pickled, tensors, rrefs = pickler.run(obj, fork)
    except ArgumentError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever pickle raises, say what failed
        raise ArgumentError(f"cannot send {what}: {type(exc).__name__}: {exc}") from exc
    if len(pickled) > _REUSE_PICKLER and pickler is _cache.pickler:
        # a pickler's memo keeps the size of the largest structure it pickled, and every
        # later clear_memo walks all of it: after one 5,000-item list a 3-item call cost
        # 133 us instead of 0.4 us (timeit). Start afresh after a large one.
        _cache.pickler = None
    amsg = 0
    if ctx_id and record is not None:
        amsg = record([t for t in tensors if t.requires_grad])
    head = _HEAD.pack(ctx_id, amsg, len(tensors), _RREFS if rrefs else 0)
    if not tensors:
        meta = len(head) + len(pickled)
        return Outgoing([memoryview(head + pickled)], meta, meta, rrefs)
    table = bytearray(head)
    views: list[memoryview] = []
    small = bytearray()  # small tensors' bytes, copied: cheaper than a view of each
    for t in tensors:
        flags = (_GRAD if t.requires_grad else 0) | (_PARAM if type(t) is torch.nn.Parameter else 0)
        ndim = t.dim()
        table += _TENSOR.pack(_CODE[t.dtype], flags, ndim)
        table += _SHAPES[ndim].pack(*t.shape)
        size = t.nbytes
        if not size:
            continue
        if size <= _SMALL and t.is_contiguous() and not (t.is_conj() or t.is_neg()):
            small += ctypes.string_at(t.data_ptr(), size)
            continue
        if small:
            views.append(memoryview(small))
            small = bytearray()
        views.append(_payload(t))
    meta = len(table) + len(pickled)
    if not views:  # a small message goes in one piece: each piece costs the transport ~1 us
        table += pickled
        table += small
        return Outgoing([memoryview(table)], meta, len(table), rrefs)
    if small:
        views.append(memoryview(small))
    nbytes = meta + sum(v.nbytes for v in views)
    return Outgoing([memoryview(table), memoryview(pickled), *views], meta, nbytes, rrefs)


class Incoming:
    """A message read off the wire, not yet unpickled."""

    __slots__ = ("ctx_id", "amsg", "tensors", "grads", "pickled", "rrefs", "error")

    def __init__(self, ctx_id: int, amsg: int, tensors: list[torch.Tensor],
                 grads: list[torch.Tensor], pickled: memoryview | bytes, rrefs: bool,
                 error: BaseException | None = None) -> None:
        self.ctx_id = ctx_id
        self.amsg = amsg
        self.tensors = tensors
        self.grads = grads  # the tensors the sender marked as requiring grad
        self.pickled = pickled
        self.rrefs = rrefs  # whether the pickle refers to RRefs
        self.error = error


def _empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def read_message(header: Header, read: Reader, src: object,
                 empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] = _empty
                 ) -> Incoming:
    """Read one message's payload: exactly ``header.nbytes`` bytes, or ProtocolError.
    ``src`` names the sender in errors (formatted only then); ``empty(shape, dtype)``
    allocates the tensors that are read straight off the wire (not copied out of a
    small message), e.g. ``ReceiveBuffers.empty``."""
    meta_len = header.group
    if meta_len < _HEAD.size or meta_len > header.nbytes:
        raise ProtocolError(f"{src} sent an RPC message with a {meta_len}-byte table in a "
                            f"{header.nbytes}-byte payload")
    whole = header.nbytes <= _SMALL  # read it all at once; tensors copied out of it
    meta = bytearray(header.nbytes if whole else meta_len)
    read(memoryview(meta))
    ctx_id, amsg, count, mflags = _HEAD.unpack_from(meta)
    if not count:
        if meta_len != header.nbytes:
            raise ProtocolError(f"{src} sent an RPC message of {header.nbytes} bytes whose "
                                f"table and pickle take {meta_len}")
        return Incoming(ctx_id, amsg, [], [], memoryview(meta)[_HEAD.size:],
                        bool(mflags & _RREFS))
    off, total, specs = _HEAD.size, meta_len, []
    try:
        for _ in range(count):
            code, flags, ndim = _TENSOR.unpack_from(meta, off)
            shape = _SHAPES[ndim].unpack_from(meta, off + _TENSOR.size)
            off += _TENSOR.size + 8 * ndim
            dtype = _DTYPES[code]
            if ndim and min(shape) < 0:
                total = -1
                break
            total += math.prod(shape) * dtype.itemsize
            specs.append((shape, dtype, flags))
    except (struct.error, IndexError) as exc:
        raise ProtocolError(f"{src} sent a malformed RPC tensor table: {exc}") from exc
    if off > meta_len or total != header.nbytes:
        raise ProtocolError(f"{src} sent an RPC message whose tensors add up to {total} bytes "
                            f"in a {header.nbytes}-byte payload")
    tensors: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    done = meta_len
    base = ctypes.addressof(ctypes.c_char.from_buffer(meta)) if whole else 0
    try:
        for shape, dtype, flags in specs:
            if whole:
                # the shape spread as arguments: parsed in ~1.1 us against ~1.6 us as a tuple
                t = torch.empty(*shape, dtype=dtype) if shape else torch.empty((), dtype=dtype)
                size = t.nbytes
                if size:
                    ctypes.memmove(t.data_ptr(), base + done, size)
            else:
                t = empty(shape, dtype)
                size = t.nbytes
                if size:
                    read(as_bytes(t))
            done += size
            if flags:
                if flags & _PARAM:
                    t = torch.nn.Parameter(t, requires_grad=bool(flags & _GRAD))
                elif flags & _GRAD:
                    t.requires_grad_(True)
                if flags & _GRAD:
                    grads.append(t)
            tensors.append(t)
    except (MemoryError, RuntimeError, OSError) as exc:
        if not whole:
            _drain(read, header.nbytes - done)
        return Incoming(ctx_id, amsg, [], [], b"", False, StateError(
            f"could not allocate the tensors of a {header.nbytes}-byte message from {src}: "
            f"{exc}"))
    return Incoming(ctx_id, amsg, tensors, grads, memoryview(meta)[off:meta_len],
                    bool(mflags & _RREFS))


def _drain(read: Reader, left: int) -> None:
    scratch = memoryview(bytearray(min(left, _DRAIN)))
    while left > 0:
        n = min(left, len(scratch))
        read(scratch[:n])
        left -= n


def decode(message: Incoming, build_rref: Callable[..., Any] | None = None) -> Any:
    """Unpickle a message read by :func:`read_message`."""
    if not message.tensors and not message.rrefs:
        return pickle.loads(message.pickled)
    local = _decoding
    saved = local.tensors, local.build_rref  # (decoding may nest: an RRef's build sends)
    local.tensors, local.build_rref = message.tensors, build_rref
    try:
        return pickle.loads(message.pickled)
    finally:
        local.tensors, local.build_rref = saved


def local_reader(parts: list[memoryview]) -> Reader:
    """A reader over an encoded message's parts: a message to this very worker."""
    flat = [p.cast("B") if p.format != "B" or p.ndim != 1 else p for p in parts]
    state = [0, 0]  # part index, offset in it

    def read(view: memoryview) -> None:
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        got = 0
        while got < len(view):
            part = flat[state[0]]
            n = min(len(view) - got, len(part) - state[1])
            view[got:got + n] = part[state[1]:state[1] + n]
            got += n
            state[1] += n
            if state[1] == len(part):
                state[0] += 1
                state[1] = 0

    return read
