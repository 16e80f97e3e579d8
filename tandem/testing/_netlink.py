"""Just enough netfilter netlink to delay packets: an nf_tables queue rule and its queue.

Two conversations with the kernel of the calling network namespace, both over
``NETLINK_NETFILTER`` sockets (root only):

* :func:`queue_rule` adds a table owned by the socket (the kernel deletes it when the
  socket closes, so no rule outlives the process that made it) with one rule,
  ``ip prerouting iifname IFACE queue num Q``;
* :class:`PacketQueue` binds queue ``Q``, receives the id of each queued packet (no
  payload is copied) and hands back verdicts: accept every packet up to an id, or drop one.

Constants are from the kernel's uapi headers (``linux/netfilter/nf_tables.h``,
``nfnetlink_queue.h``); values on the wire are big-endian unless noted.
"""

from __future__ import annotations

import errno
import os
import socket
import struct

__all__ = ["NetlinkError", "queue_rule", "PacketQueue"]

NETLINK_NETFILTER = 12
NLM_F_REQUEST, NLM_F_ACK, NLM_F_EXCL, NLM_F_CREATE, NLM_F_APPEND = 1, 4, 0x200, 0x400, 0x800
NLMSG_ERROR = 2
NLA_F_NESTED = 0x8000
NFPROTO_IPV4 = 2
# subsystems (the high byte of a message type)
SUBSYS_QUEUE, SUBSYS_NFTABLES = 3, 10
BATCH_BEGIN, BATCH_END = 0x10, 0x11
# nf_tables messages and attributes
NEWTABLE, NEWCHAIN, NEWRULE = 0, 3, 6
TABLE_NAME, TABLE_FLAGS, TABLE_F_OWNER = 1, 2, 2
CHAIN_TABLE, CHAIN_NAME, CHAIN_HOOK, CHAIN_POLICY, CHAIN_TYPE = 1, 3, 4, 5, 7
HOOK_NUM, HOOK_PRIORITY, HOOK_PREROUTING = 1, 2, 0
RULE_TABLE, RULE_CHAIN, RULE_EXPRESSIONS = 1, 2, 4
LIST_ELEM, EXPR_NAME, EXPR_DATA = 1, 1, 2
META_DREG, META_KEY, META_IIFNAME = 1, 2, 6
CMP_SREG, CMP_OP, CMP_DATA, CMP_EQ, DATA_VALUE = 1, 2, 3, 0, 1
# the xt NFQUEUE target through nft_compat (kernels without the nft "queue" expression)
TARGET_NAME, TARGET_REV, TARGET_INFO = 1, 2, 3
REG_1 = 1
NF_DROP, NF_ACCEPT = 0, 1
# nfnetlink_queue messages and attributes
QMSG_PACKET, QMSG_VERDICT, QMSG_CONFIG, QMSG_VERDICT_BATCH = 0, 1, 2, 3
QA_PACKET_HDR, QA_VERDICT_HDR = 1, 2
QCFG_CMD, QCFG_PARAMS, QCFG_QUEUE_MAXLEN, QCFG_MASK, QCFG_FLAGS = 1, 2, 3, 4, 5
QCMD_BIND, QCOPY_META, QCFG_F_GSO = 1, 1, 4
SOL_NETLINK, NETLINK_NO_ENOBUFS = 270, 5

_NLMSG = struct.Struct("=IHHII")  # length, type, flags, sequence, port id (host order)
_NFGEN = struct.Struct("=BBH")  # family, version, resource id (already big-endian)
_ATTR = struct.Struct("=HH")  # length, type (host order)


class NetlinkError(OSError):
    """The kernel refused a request; ``errno`` says why."""


def _attr(kind: int, payload: bytes, nested: bool = False) -> bytes:
    head = _ATTR.pack(_ATTR.size + len(payload), kind | (NLA_F_NESTED if nested else 0))
    return head + payload + b"\0" * (-len(payload) % 4)


def _nest(kind: int, *attrs: bytes) -> bytes:
    return _attr(kind, b"".join(attrs), nested=True)


def _u32(kind: int, value: int) -> bytes:
    return _attr(kind, struct.pack(">I", value & 0xFFFFFFFF))


def _u16(kind: int, value: int) -> bytes:
    return _attr(kind, struct.pack(">H", value))


def _str(kind: int, text: str) -> bytes:
    return _attr(kind, text.encode() + b"\0")


def _message(kind: int, flags: int, seq: int, family: int, resource: int, body: bytes) -> bytes:
    payload = _NFGEN.pack(family, 0, socket.htons(resource)) + body
    return _NLMSG.pack(_NLMSG.size + len(payload), kind, flags, seq, 0) + payload


def _attrs(data: bytes) -> dict[int, bytes]:
    """Top-level attributes of a message body (after its nfgenmsg)."""
    out, at = {}, 0
    while at + _ATTR.size <= len(data):
        length, kind = _ATTR.unpack_from(data, at)
        if length < _ATTR.size:
            break
        out[kind & ~NLA_F_NESTED] = data[at + _ATTR.size:at + length]
        at += (length + 3) & ~3
    return out


def _open(rcvbuf: int = 0) -> socket.socket:
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    if rcvbuf:
        # SO_RCVBUFFORCE (root) goes past rmem_max: a burst of queued packets must not
        # overflow the socket, which would drop them
        sock.setsockopt(socket.SOL_SOCKET, 33, rcvbuf)
    sock.bind((0, 0))
    return sock


def _expect_acks(sock: socket.socket, seqs: set[int], timeout: float) -> None:
    sock.settimeout(timeout)
    try:
        while seqs:
            data = sock.recv(1 << 16)
            at = 0
            while at + _NLMSG.size <= len(data):
                length, kind, _, seq, _ = _NLMSG.unpack_from(data, at)
                if kind == NLMSG_ERROR:
                    code = -struct.unpack_from("=i", data, at + _NLMSG.size)[0]
                    if code:
                        raise NetlinkError(code, f"netfilter netlink request {seq}: "
                                                 f"{os.strerror(code)}")
                    seqs.discard(seq)
                at += (length + 3) & ~3
    except socket.timeout as exc:
        raise NetlinkError(errno.ETIMEDOUT, "netfilter netlink sent no acknowledgement") from exc
    finally:
        sock.settimeout(None)


def queue_rule(iface: str, queue: int, table: str = "tandemlab",
               timeout: float = 5.0) -> socket.socket:
    """Queue every IPv4 packet arriving on ``iface`` to ``queue``; keep the result open.

    The table belongs to the returned socket: closing it, or the process exiting,
    removes the rule.
    """
    sock = _open()
    ifname = iface.encode().ljust(16, b"\0")  # the kernel compares all IFNAMSIZ bytes
    nft = SUBSYS_NFTABLES << 8
    ack = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE
    expressions = _nest(
        RULE_EXPRESSIONS,
        _nest(LIST_ELEM, _str(EXPR_NAME, "meta"),
              _nest(EXPR_DATA, _u32(META_DREG, REG_1), _u32(META_KEY, META_IIFNAME))),
        _nest(LIST_ELEM, _str(EXPR_NAME, "cmp"),
              _nest(EXPR_DATA, _u32(CMP_SREG, REG_1), _u32(CMP_OP, CMP_EQ),
                    _nest(CMP_DATA, _attr(DATA_VALUE, ifname)))),
        _nest(LIST_ELEM, _str(EXPR_NAME, "target"),
              _nest(EXPR_DATA, _str(TARGET_NAME, "NFQUEUE"), _u32(TARGET_REV, 0),
                    # struct xt_NFQ_info (host order), padded to XT_ALIGN
                    _attr(TARGET_INFO, struct.pack("=H", queue).ljust(8, b"\0")))))
    batch = [
        _message(BATCH_BEGIN, NLM_F_REQUEST, 1, 0, SUBSYS_NFTABLES, b""),
        _message(nft | NEWTABLE, ack | NLM_F_EXCL, 2, NFPROTO_IPV4, 0,
                 _str(TABLE_NAME, table) + _u32(TABLE_FLAGS, TABLE_F_OWNER)),
        _message(nft | NEWCHAIN, ack, 3, NFPROTO_IPV4, 0,
                 _str(CHAIN_TABLE, table) + _str(CHAIN_NAME, "delay")
                 + _nest(CHAIN_HOOK, _u32(HOOK_NUM, HOOK_PREROUTING), _u32(HOOK_PRIORITY, -300))
                 + _str(CHAIN_TYPE, "filter") + _u32(CHAIN_POLICY, NF_ACCEPT)),
        _message(nft | NEWRULE, ack | NLM_F_APPEND, 4, NFPROTO_IPV4, 0,
                 _str(RULE_TABLE, table) + _str(RULE_CHAIN, "delay") + expressions),
        _message(BATCH_END, NLM_F_REQUEST, 5, 0, SUBSYS_NFTABLES, b""),
    ]
    try:
        sock.sendto(b"".join(batch), (0, 0))
        _expect_acks(sock, {2, 3, 4}, timeout)
    except BaseException:
        sock.close()
        raise
    return sock


class PacketQueue:
    """Queue ``num`` of this namespace: packet ids in, verdicts out."""

    def __init__(self, num: int, maxlen: int = 1 << 14, timeout: float = 5.0) -> None:
        self.num = num
        self.sock = _open(rcvbuf=64 << 20)
        self._seq = 10
        cfg = SUBSYS_QUEUE << 8 | QMSG_CONFIG
        flags = NLM_F_REQUEST | NLM_F_ACK
        try:
            self.sock.sendto(_message(cfg, flags, 1, 0, num, _attr(
                QCFG_CMD, struct.pack(">BBH", QCMD_BIND, 0, socket.AF_INET))), (0, 0))
            # metadata only: the payload stays in the kernel; whole GSO packets, never
            # segmented for our sake
            self.sock.sendto(_message(cfg, flags, 2, 0, num,
                                      _attr(QCFG_PARAMS, struct.pack(">IB", 0, QCOPY_META))
                                      + _u32(QCFG_QUEUE_MAXLEN, maxlen)
                                      + _u32(QCFG_MASK, QCFG_F_GSO)
                                      + _u32(QCFG_FLAGS, QCFG_F_GSO)), (0, 0))
            _expect_acks(self.sock, {1, 2}, timeout)
            self.sock.setsockopt(SOL_NETLINK, NETLINK_NO_ENOBUFS, 1)
        except BaseException:
            self.sock.close()
            raise

    def fileno(self) -> int:
        return self.sock.fileno()

    def receive(self) -> list[int]:
        """Ids of the packets queued since the last call (never blocks)."""
        ids: list[int] = []
        while True:
            try:
                data = self.sock.recv(1 << 16, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return ids
            at = 0
            while at + _NLMSG.size <= len(data):
                length, kind, _, _, _ = _NLMSG.unpack_from(data, at)
                if kind == SUBSYS_QUEUE << 8 | QMSG_PACKET:
                    body = data[at + _NLMSG.size + _NFGEN.size:at + length]
                    head = _attrs(body).get(QA_PACKET_HDR)
                    if head is not None:
                        ids.append(struct.unpack_from(">I", head)[0])
                at += (length + 3) & ~3

    def _verdict(self, kind: int, verdict: int, packet: int) -> None:
        self._seq += 1
        self.sock.sendto(_message(SUBSYS_QUEUE << 8 | kind, NLM_F_REQUEST, self._seq, 0,
                                  self.num, _attr(QA_VERDICT_HDR,
                                                  struct.pack(">II", verdict, packet))), (0, 0))

    def accept_through(self, packet: int) -> None:
        """Let every packet still queued with an id up to ``packet`` go on."""
        self._verdict(QMSG_VERDICT_BATCH, NF_ACCEPT, packet)

    def drop(self, packet: int) -> None:
        self._verdict(QMSG_VERDICT, NF_DROP, packet)

    def close(self) -> None:
        self.sock.close()
