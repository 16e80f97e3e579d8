"""What a simulated host's network link looks like: rate, delay, loss.

    shape = LinkShape.parse("1gbit:0.2ms")          # or "10gbit:1ms:0.1%", "100mbit"
    shape.rate_bytes                                # 125e6 bytes/s
    shape.tbf_args()                                # ["rate", "1000000000bit", ...]

A shape applies to every host's link of a :class:`tandem.testing.netns.NetnsLab`:

* rate: a token bucket (``tc qdisc ... tbf``) on each side of the host's veth, so the
  host sends at most ``rate`` and receives at most ``rate`` (ranks of one host share
  it, as they share a NIC);
* delay: one way, added to every packet the host receives (``tandem.testing._delay``),
  so a round trip between two hosts takes ``2 * delay`` more, as with netem on each
  host's interface;
* loss: each packet a host receives is dropped with this probability.

Rates use tc's units (``bit``, ``kbit``, ``mbit``, ``gbit``: powers of 1000) and count
whole Ethernet frames, so TCP payload moves at about 95% of the rate (1448 of every
1514 bytes at MTU 1500). Delays take ``s``, ``ms`` or ``us``; loss a percentage or a
fraction.
"""

from __future__ import annotations

import dataclasses
import re

__all__ = ["LinkShape"]

_RATE = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_PER_SECOND = {"s": 1.0, "ms": 1e3, "us": 1e6}
_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"


@dataclasses.dataclass(frozen=True)
class LinkShape:
    """One host link: ``rate_bits`` per second each way (0: unshaped), one-way ``delay_s``,
    and the probability ``loss`` that a received packet is dropped."""

    rate_bits: float = 0.0
    delay_s: float = 0.0
    loss: float = 0.0

    def __post_init__(self) -> None:
        if self.rate_bits < 0 or self.delay_s < 0 or not 0 <= self.loss < 1:
            raise ValueError(f"bad link shape {self!r}: rate and delay must be >= 0, "
                             f"loss in [0, 1)")
        if 0 < self.rate_bits < 1e5:
            raise ValueError(f"link rate {self.rate_bits:g} bit/s is below 100kbit")

    @classmethod
    def parse(cls, text: str) -> "LinkShape":
        """``RATE[:DELAY[:LOSS]]``, e.g. ``1gbit:0.2ms``, ``10gbit:1ms:0.5%``; RATE may be
        ``unshaped`` (or empty) to keep the veth's own speed."""
        parts = [p.strip().lower() for p in text.split(":")]
        if len(parts) > 3:
            raise ValueError(f"bad link {text!r}: use RATE[:DELAY[:LOSS]], e.g. 1gbit:0.2ms")
        rate = 0.0
        if parts[0] not in ("", "unshaped"):
            m = re.fullmatch(_NUMBER + r"\s*(bit|kbit|mbit|gbit|tbit)", parts[0])
            if not m:
                raise ValueError(f"bad link rate {parts[0]!r}: use e.g. 100mbit, 1gbit, 10gbit")
            rate = float(m.group(1)) * _RATE[m.group(2)]
        delay = 0.0
        if len(parts) > 1 and parts[1]:
            m = re.fullmatch(_NUMBER + r"\s*(s|ms|us)", parts[1])
            if not m:
                raise ValueError(f"bad link delay {parts[1]!r}: use e.g. 0.2ms, 1ms, 50us")
            delay = float(m.group(1)) / _PER_SECOND[m.group(2)]
        loss = 0.0
        if len(parts) > 2 and parts[2]:
            m = re.fullmatch(_NUMBER + r"\s*(%?)", parts[2])
            if not m:
                raise ValueError(f"bad link loss {parts[2]!r}: use e.g. 0.1% or 0.001")
            loss = float(m.group(1)) / (100 if m.group(2) else 1)
        return cls(rate, delay, loss)

    @property
    def shaped(self) -> bool:
        return bool(self.rate_bits or self.delay_s or self.loss)

    @property
    def rate_bytes(self) -> float:
        """Bytes per second each way (0: unshaped)."""
        return self.rate_bits / 8

    def tbf_args(self) -> list[str]:
        """``tc qdisc add dev D root tbf ...`` arguments for the rate (needs ``rate_bits``)."""
        # the bucket holds a millisecond of traffic, and at least two 64 KiB GSO packets,
        # which tbf would otherwise cut into segments; the queue behind it holds 10 ms
        burst = max(int(self.rate_bytes * 1e-3), 128 << 10)
        return ["rate", f"{int(self.rate_bits)}bit", "burst", str(burst), "latency", "10ms"]

    def __str__(self) -> str:
        rate = "unshaped"
        if self.rate_bits:
            unit = next(u for u in ("tbit", "gbit", "mbit", "kbit", "bit")
                        if self.rate_bits >= _RATE[u])
            rate = f"{self.rate_bits / _RATE[unit]:g}{unit}"
        text = rate
        if self.delay_s or self.loss:
            text += f":{self.delay_s * 1e3:g}ms"
        if self.loss:
            text += f":{self.loss * 100:g}%"
        return text
