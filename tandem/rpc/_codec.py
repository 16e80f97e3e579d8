"""RPC messages on the wire: a pickled structure with tensors travelling beside it.

One message is one transport frame (``Kind.RPC``) whose payload is::

    table    ctx id (u64), autograd message id (u64), tensor count (u32), flags (u8: RRefs
             inside; the message's short form, below), then per tensor:
             dtype code (u8), flags (u8: requires grad, is a Parameter), ndim (u8), shape
    pickle   the structure; each tensor in it is a reference to its index in the table
    tensors  each tensor's raw bytes, in table order

Two common messages have a short form with no structure to pickle or unpickle around
their tensors: a bare tensor (most results: ``BARE``, one tensor, an empty pickle) and a
call whose arguments are all tensors, each once, of a function that travels by name
(``ARGS``: the pickle is the function alone; the arguments are the table's tensors in
order, no keywords; the function's pickle is remembered per function). Each saves the
structure's pickling and a tensor reference per tensor on both sides; measured (one
process, CPU time, best of 25, 3 runs): a 16-float echo's call and reply cost 37.5 us to
encode, read and decode through the pickle, 23.6 us this way (encoding 18.8 -> 8.8 us,
decoding 4.7 -> 1.4 us; reading the table and the tensor, ~7 us each, is unchanged).

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

import copyreg
import ctypes
import math
import pickle
import struct
import threading
import types
from typing import Any, Callable, Sequence

import torch

from tandem.collectives.group import as_bytes
from tandem.errors import ArgumentError, ProtocolError, StateError
from tandem.transport.base import Header, Reader

__all__ = ["Outgoing", "Incoming", "encode", "encode_call", "read_message", "decode",
           "local_reader",
           "CALL", "REMOTE", "REPLY", "ERROR", "NOTE"]

# message types, in the header's ``step`` (see ``_agent``)
CALL, REMOTE, REPLY, ERROR, NOTE = 0, 1, 2, 3, 4

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
           torch.complex128]
_CODE = {d: i for i, d in enumerate(_DTYPES)}
_HEAD = struct.Struct("<QQIB")  # ctx id, autograd message id, tensor count, flags
_TENSOR = struct.Struct("<BBB")  # dtype code, flags, ndim; then the shape
_SHAPES = [struct.Struct(f"<{n}q") for n in range(256)]
_ENTRY = [struct.Struct(f"<BBB{n}q") for n in range(256)]  # one tensor's whole entry
_STRIDED = torch.strided
_PARAMETER = torch.nn.Parameter
_ITEMSIZE = [d.itemsize for d in _DTYPES]
_PROTOS = [torch.empty(0, dtype=d) for d in _DTYPES]  # new_empty's receivers, per dtype
_GRAD, _PARAM = 1, 2  # per tensor
# per message: the pickle refers to RRefs; the message's two short forms (see above)
_RREFS, _BARE, _ARGS = 1, 2, 4
_FORMS = _BARE | _ARGS
_FLAGS = _RREFS | _FORMS
_BY_NAME = (types.FunctionType, types.BuiltinFunctionType)  # functions pickled by name
# The pickles of functions called with tensor arguments (``encode_call``), by function: a
# function's pickle is its module and name, the same each time. Measured: ~2 us to pickle
# a module-level function, ~0.05 us to look it up. Cleared when full.
_NAMES: dict[Any, bytes] = {}
_MAX_NAMES = 1024
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
                 rrefs: Sequence[tuple[Any, Any]]) -> None:
        self.parts = parts
        self.meta_bytes = meta_bytes
        self.nbytes = nbytes
        self.rrefs = rrefs  # (RRef, fork id) for every RRef in the message


class _Reducers(dict[type, Callable[[Any], Any]]):
    """A pickler's ``dispatch_table``: tensors and RRefs by exact type, the rest as
    ``copyreg`` says. The C pickler consults it only for objects that are not built-in
    containers, strings, numbers or functions, so unlike a ``reducer_override`` (called
    for every function, tensor reference and object) it costs no Python call for those
    (~0.5 us each)."""

    def __init__(self, pickler: "_Pickler") -> None:
        super().__init__({torch.Tensor: pickler.tensor, torch.nn.Parameter: pickler.tensor})
        self.rref = pickler.rref

    def __missing__(self, cls: type) -> Callable[[Any], Any]:
        if getattr(cls, "_tandem_rref", False):
            self[cls] = self.rref
            return self.rref
        return copyreg.dispatch_table[cls]  # (KeyError: the object reduces itself)


class _Chunks(list[bytes]):
    """What a pickler writes to: its output pieces (usually one), kept as they come."""

    write = list.append


class _Pickler(pickle.Pickler):
    def __init__(self) -> None:
        self.chunks = _Chunks()  # (measured: ~0.15 us less per message than a BytesIO)
        self.dispatch_table = _Reducers(self)  # (the C pickler reads it in __init__)
        super().__init__(self.chunks, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self.codes: list[int] = []  # each tensor's dtype code
        self.rrefs: list[tuple[Any, Any]] = []
        self._fork: Callable[[Any], tuple[Any, ...]] | None = None
        self.busy = False

    def run(self, obj: Any, fork: Callable[[Any], tuple[Any, ...]] | None
            ) -> tuple[bytes, Sequence[torch.Tensor], Sequence[int], Sequence[tuple[Any, Any]]]:
        """Pickle ``obj``: the bytes, the tensors it referred to with their dtype codes,
        and its RRefs. Nothing of ``obj`` stays referenced here afterwards (an RRef kept
        alive would never be freed)."""
        self._fork, self.busy = fork, True
        chunks = self.chunks
        try:
            self.dump(obj)
            pickled = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            tensors: Sequence[torch.Tensor] = ()
            codes: Sequence[int] = ()
            rrefs: Sequence[tuple[Any, Any]] = ()
            if self.tensors:
                tensors, codes, self.tensors, self.codes = self.tensors, self.codes, [], []
            if self.rrefs:
                rrefs, self.rrefs = self.rrefs, []
            return pickled, tensors, codes, rrefs
        finally:
            chunks.clear()
            self.clear_memo()
            if self.tensors or self.rrefs:  # pickling failed halfway
                self.tensors, self.codes, self.rrefs = [], [], []
            self._fork, self.busy = None, False

    def tensor(self, t: torch.Tensor) -> Any:
        if t.is_cpu:  # (``device.type`` builds a device object: ~1 us)
            if t.layout is _STRIDED:
                code = _CODE.get(t.dtype)
                if code is not None:
                    self.tensors.append(t)
                    self.codes.append(code)
                    return _tensor_ref, (len(self.codes) - 1,)
        elif not t.is_meta:
            raise ArgumentError(f"cannot send a tensor on {t.device}: tandem's RPC "
                                f"moves CPU tensors; call .cpu() first")
        return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)  # sparse, quantized: torch's pickling

    def rref(self, obj: Any) -> Any:
        if self._fork is None:
            return obj.__reduce_ex__(pickle.HIGHEST_PROTOCOL)  # (it says why it cannot go)
        fields = self._fork(obj)
        self.rrefs.append((obj, fields[2]))
        return _rref_ref, fields


class _Checker(pickle.Pickler):
    """Finds why a message cannot be pickled, once pickling it failed: a function that
    has no importable name. Pickles into nothing; tensors and RRefs are not looked at."""

    def __init__(self) -> None:
        super().__init__(_Discard(), protocol=pickle.HIGHEST_PROTOCOL)

    def reducer_override(self, obj: Any) -> Any:
        cls = type(obj)
        if cls is types.FunctionType and ("<lambda>" in obj.__qualname__
                                          or "<locals>" in obj.__qualname__):
            raise ArgumentError(
                f"cannot send function {obj.__qualname__!r} (module {obj.__module__}): "
                f"functions travel by reference and a lambda or a function defined inside "
                f"another function has no importable name; define it at module level")
        if cls is torch.Tensor or cls is torch.nn.Parameter or getattr(cls, "_tandem_rref",
                                                                        False):
            return int, ()
        return NotImplemented


class _Discard:
    def write(self, data: bytes) -> int:
        return len(data)


def _refusal(obj: Any, what: str, exc: Exception) -> ArgumentError:
    """The error for a message that could not be pickled (``exc``): the offending function
    named when that is why, else what pickle said."""
    if isinstance(exc, ArgumentError):
        return exc
    try:
        _Checker().dump(obj)
    except ArgumentError as found:
        return found
    except Exception:  # noqa: BLE001 - the original error says it
        pass
    return ArgumentError(f"cannot send {what}: {type(exc).__name__}: {exc}")


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


def _plain(t: torch.Tensor) -> int:
    """The dtype code of a tensor that travels beside the pickle; -1 for one that torch
    pickles itself (sparse, quantized); ArgumentError for one on an accelerator."""
    if t.is_cpu:  # (``device.type`` builds a device object: ~1 us)
        if t.layout is _STRIDED:
            return _CODE.get(t.dtype, -1)
    elif not t.is_meta:
        raise ArgumentError(f"cannot send a tensor on {t.device}: tandem's RPC moves CPU "
                            f"tensors; call .cpu() first")
    return -1


def _pickle(obj: Any, what: str, fork: Callable[[Any], tuple[Any, ...]] | None
            ) -> tuple[bytes, Sequence[torch.Tensor], Sequence[int], Sequence[tuple[Any, Any]]]:
    pickler = _pickler()
    try:
        out = pickler.run(obj, fork)
    except Exception as exc:  # noqa: BLE001 - whatever pickle raises, say what failed
        raise _refusal(obj, what, exc) from exc
    if len(out[0]) > _REUSE_PICKLER and pickler is _cache.pickler:
        # a pickler's memo keeps the size of the largest structure it pickled, and every
        # later clear_memo walks all of it: after one 5,000-item list a 3-item call cost
        # 133 us instead of 0.4 us (timeit). Start afresh after a large one.
        _cache.pickler = None
    return out


def encode(obj: Any, what: str, fork: Callable[[Any], tuple[Any, ...]] | None = None,
           ctx_id: int = 0, record: Callable[[list[torch.Tensor]], int] | None = None) -> Outgoing:
    """Encode ``obj``; ``what`` names it in errors. With ``ctx_id`` set (distributed
    autograd), ``record(tensors requiring grad) -> message id`` records the send."""
    cls = type(obj)
    if cls is torch.Tensor or cls is _PARAMETER:
        code = _plain(obj)
        if code >= 0:  # a bare tensor (a result, mostly): no pickle at all
            return _assemble(b"", [obj], [code], [], _BARE, ctx_id, record)
    pickled, tensors, codes, rrefs = _pickle(obj, what, fork)
    return _assemble(pickled, tensors, codes, rrefs, _RREFS if rrefs else 0, ctx_id, record)


def encode_call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None, what: str,
                fork: Callable[[Any], tuple[Any, ...]] | None = None, ctx_id: int = 0,
                record: Callable[[list[torch.Tensor]], int] | None = None) -> Outgoing:
    """Encode the call ``func(*args, **kwargs)`` (:func:`decode` gives the triple back)."""
    if kwargs is None and args:
        codes = []
        for a in args:
            if type(a) is not torch.Tensor and type(a) is not _PARAMETER:
                break
            code = _plain(a)
            if code < 0:
                break
            codes.append(code)
        else:
            if type(func) in _BY_NAME and (len(args) == 1
                                           or len(set(map(id, args))) == len(args)):
                # arguments that are all tensors, each once, for a function that travels
                # by name: the pickle holds the function alone, and the receiver takes the
                # arguments straight from the table
                pickled = _NAMES.get(func)
                if pickled is None:
                    pickled = _name_of(func, what, fork)
                if pickled is not None:
                    return _assemble(pickled, list(args), codes, (), _ARGS, ctx_id, record)
    return encode((func, args, kwargs), what, fork, ctx_id, record)


def _name_of(func: Any, what: str, fork: Callable[[Any], tuple[Any, ...]] | None
             ) -> bytes | None:
    """The pickle of ``func`` if it is a reference by name alone (None if it carries
    tensors or RRefs: a builtin bound to a tensor), remembered for the next call."""
    pickled, inside, _, rrefs = _pickle(func, what, fork)
    if inside or rrefs:
        return None
    owner = getattr(func, "__self__", None)
    if type(func) is types.FunctionType or owner is None or type(owner) is types.ModuleType:
        if len(_NAMES) >= _MAX_NAMES:
            _NAMES.clear()
        _NAMES[func] = pickled  # (a builtin bound to another object pickles that object)
    return pickled


def _assemble(pickled: bytes, tensors: Sequence[torch.Tensor], codes: Sequence[int],
              rrefs: Sequence[tuple[Any, Any]], mflags: int, ctx_id: int,
              record: Callable[[list[torch.Tensor]], int] | None) -> Outgoing:
    """The message: table, pickle and the tensors' bytes."""
    amsg = 0
    if ctx_id and record is not None:
        amsg = record([t for t in tensors if t.requires_grad])
    if not tensors:  # one pickle behind the head: nothing else to build
        head = _HEAD.pack(ctx_id, amsg, 0, mflags)
        meta = len(head) + len(pickled)
        return Outgoing([memoryview(head + pickled)], meta, meta, rrefs)
    table = bytearray(_HEAD.pack(ctx_id, amsg, len(tensors), mflags))
    views: list[memoryview] = []
    small = bytearray()  # small tensors' bytes, copied: cheaper than a view of each
    for t, code in zip(tensors, codes):
        shape = t.shape
        flags = (_GRAD if t.requires_grad else 0) | (_PARAM if type(t) is _PARAMETER else 0)
        table += _ENTRY[len(shape)].pack(code, flags, len(shape), *shape)
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

    __slots__ = ("ctx_id", "amsg", "tensors", "grads", "pickled", "form", "rrefs", "error")

    def __init__(self, ctx_id: int, amsg: int, tensors: list[torch.Tensor],
                 grads: list[torch.Tensor], pickled: memoryview | bytes, flags: int,
                 error: BaseException | None = None) -> None:
        self.ctx_id = ctx_id
        self.amsg = amsg
        self.tensors = tensors
        self.grads = grads  # the tensors the sender marked as requiring grad
        self.pickled = pickled
        self.form = flags & _FORMS  # a bare tensor, a call of tensors, or a pickle
        self.rrefs = bool(flags & _RREFS)  # whether the pickle refers to RRefs
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
    meta_len, nbytes = header.group, header.nbytes
    if meta_len < _HEAD.size or meta_len > nbytes:
        raise ProtocolError(f"{src} sent an RPC message with a {meta_len}-byte table in a "
                            f"{nbytes}-byte payload")
    whole = nbytes <= _SMALL  # read it all at once; tensors copied out of it
    meta = bytearray(nbytes if whole else meta_len)
    read(memoryview(meta))
    ctx_id, amsg, count, mflags = _HEAD.unpack_from(meta)
    form = mflags & _FORMS
    if mflags & ~_FLAGS or (form and (form == _FORMS or not count or mflags & _RREFS)) or (
            form == _BARE and count != 1):
        raise ProtocolError(f"{src} sent an RPC message with flags {mflags:#x} and "
                            f"{count} tensors")
    if not count:
        if meta_len != nbytes:
            raise ProtocolError(f"{src} sent an RPC message of {nbytes} bytes whose "
                                f"table and pickle take {meta_len}")
        return Incoming(ctx_id, amsg, [], [], memoryview(meta)[_HEAD.size:], mflags)
    off, total, specs = _HEAD.size, meta_len, []
    try:
        for _ in range(count):
            code, flags, ndim = _TENSOR.unpack_from(meta, off)
            shape = _SHAPES[ndim].unpack_from(meta, off + _TENSOR.size)
            off += _TENSOR.size + 8 * ndim
            size = math.prod(shape) * _ITEMSIZE[code]
            if ndim and min(shape) < 0:
                total = -1
                break
            total += size
            specs.append((shape, code, flags, size))
    except (struct.error, IndexError) as exc:
        raise ProtocolError(f"{src} sent a malformed RPC tensor table: {exc}") from exc
    if off > meta_len or total != nbytes or (form == _BARE and off != meta_len):
        raise ProtocolError(f"{src} sent an RPC message whose tensors add up to {total} bytes "
                            f"in a {nbytes}-byte payload")
    tensors: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    done = meta_len
    base = ctypes.addressof(ctypes.c_char.from_buffer(meta)) if whole else 0
    lend = None if whole else getattr(read, "lend", None)
    try:
        for shape, code, flags, size in specs:
            if whole:
                # a prototype's new_empty with the shape spread as arguments: ~1.2 us,
                # against ~2.1 us for torch.empty(shape, dtype=...) (keywords are slow)
                t = _PROTOS[code].new_empty(*shape) if shape else _PROTOS[code].new_empty(())
                if size:
                    ctypes.memmove(t.data_ptr(), base + done, size)
            else:
                # over shared memory a large tensor may come in memory the sender lent:
                # the tensor is a view of it, nothing to copy (``read.lend``)
                lent = lend(size) if lend is not None and size else None
                if lent is not None:
                    t = torch.frombuffer(lent, dtype=torch.uint8).view(_DTYPES[code])
                    t = t.view(shape)
                else:
                    t = empty(shape, _DTYPES[code])
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
            _drain(read, nbytes - done)
        return Incoming(ctx_id, amsg, [], [], b"", 0, StateError(
            f"could not allocate the tensors of a {nbytes}-byte message from {src}: {exc}"))
    return Incoming(ctx_id, amsg, tensors, grads, memoryview(meta)[off:meta_len], mflags)


def _drain(read: Reader, left: int) -> None:
    scratch = memoryview(bytearray(min(left, _DRAIN)))
    while left > 0:
        n = min(left, len(scratch))
        read(scratch[:n])
        left -= n


def decode(message: Incoming, build_rref: Callable[..., Any] | None = None) -> Any:
    """Unpickle a message read by :func:`read_message`."""
    form = message.form
    if form:
        if form == _BARE:
            return message.tensors[0]
        return pickle.loads(message.pickled), tuple(message.tensors), None
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
