"""The loss curve as a PNG: matplotlib when installed, else rasterised here (zlib + struct).

The fallback draws axes, horizontal grid lines labelled with a 3x5 pixel digit font,
the training loss (blue) and validation losses (red squares); no text beyond numbers.
"""

from __future__ import annotations

import math
import struct
import zlib
from typing import Sequence

__all__ = ["write_loss_png", "write_png"]

Point = tuple[float, float]
RGB = tuple[int, int, int]

_DIGITS = {  # 3x5 bitmaps, rows top to bottom
    "0": ("111", "101", "101", "101", "111"), "1": ("010", "110", "010", "010", "111"),
    "2": ("111", "001", "111", "100", "111"), "3": ("111", "001", "111", "001", "111"),
    "4": ("101", "101", "111", "001", "001"), "5": ("111", "100", "111", "001", "111"),
    "6": ("111", "100", "111", "101", "111"), "7": ("111", "001", "010", "010", "010"),
    "8": ("111", "101", "111", "101", "111"), "9": ("111", "101", "111", "001", "111"),
    ".": ("000", "000", "000", "000", "010"),
}


def write_png(path: str, width: int, height: int, rgb: bytes | bytearray) -> None:
    """Write 8-bit RGB pixels (row-major, ``width * height * 3`` bytes) as a PNG file."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(
            ">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    stride = width * 3
    raw = b"".join(b"\x00" + bytes(rgb[y * stride:(y + 1) * stride]) for y in range(height))
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n")
        f.write(chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)))
        f.write(chunk(b"IDAT", zlib.compress(raw, 9)))
        f.write(chunk(b"IEND", b""))


class _Canvas:
    def __init__(self, width: int, height: int) -> None:
        self.w, self.h = width, height
        self.px = bytearray(b"\xff" * (width * height * 3))

    def dot(self, x: int, y: int, c: RGB, size: int = 1) -> None:
        for yy in range(y, y + size):
            for xx in range(x, x + size):
                if 0 <= xx < self.w and 0 <= yy < self.h:
                    i = (yy * self.w + xx) * 3
                    self.px[i:i + 3] = bytes(c)

    def line(self, x0: int, y0: int, x1: int, y1: int, c: RGB, size: int = 1) -> None:
        steps = max(abs(x1 - x0), abs(y1 - y0), 1)
        for s in range(steps + 1):
            self.dot(round(x0 + (x1 - x0) * s / steps), round(y0 + (y1 - y0) * s / steps), c, size)

    def text(self, x: int, y: int, s: str, c: RGB, scale: int = 2) -> None:
        for k, ch in enumerate(s):
            for row, bits in enumerate(_DIGITS.get(ch, ("000",) * 5)):
                for col, bit in enumerate(bits):
                    if bit == "1":
                        self.dot(x + (4 * k + col) * scale, y + row * scale, c, scale)


def _nice_step(span: float, parts: int) -> float:
    """The smallest 1, 2 or 5 times a power of ten that cuts ``span`` into <= ``parts``."""
    base = 10.0 ** math.floor(math.log10(span / parts)) if span > 0 else 1.0
    return next(m * base for m in (1, 2, 5, 10) if span / (m * base) <= parts)


def _fallback(path: str, train: Sequence[Point], val: Sequence[Point]) -> None:
    w, h, left, right, top, bottom = 640, 400, 56, 16, 16, 40
    cv = _Canvas(w, h)
    pts = list(train) + list(val)
    x_lo, x_hi = min(p[0] for p in pts), max(p[0] for p in pts)
    x_hi = x_hi if x_hi > x_lo else x_lo + 1
    y_step = _nice_step(max(p[1] for p in pts), 5)
    y_lo, y_hi = 0.0, y_step * math.ceil(max(p[1] for p in pts) / y_step)
    x_step = _nice_step(x_hi - x_lo, 6)

    def xy(p: Point) -> tuple[int, int]:
        return (round(left + (p[0] - x_lo) / (x_hi - x_lo) * (w - left - right)),
                round(h - bottom - (p[1] - y_lo) / (y_hi - y_lo) * (h - top - bottom)))

    for k in range(round(y_hi / y_step) + 1):  # grid with loss labels
        value = k * y_step
        _, y = xy((x_lo, value))
        cv.line(left, y, w - right, y, (225, 225, 225))
        cv.text(6, y - 5, f"{value:.1f}", (60, 60, 60))
    step = math.ceil(x_lo / x_step) * x_step
    while step <= x_hi:  # step labels
        x, _ = xy((step, 0))
        cv.line(x, h - bottom, x, h - bottom + 4, (0, 0, 0))
        cv.text(x - 4 * len(str(round(step))), h - bottom + 10, str(round(step)), (60, 60, 60))
        step += x_step
    cv.line(left, top, left, h - bottom, (0, 0, 0))
    cv.line(left, h - bottom, w - right, h - bottom, (0, 0, 0))
    for a, b in zip(train, train[1:]):
        cv.line(*xy(a), *xy(b), (31, 119, 180), 2)
    for p in val:
        x, y = xy(p)
        cv.dot(x - 3, y - 3, (214, 39, 40), 7)
    write_png(path, w, h, cv.px)


def write_loss_png(path: str, train: Sequence[Point], val: Sequence[Point] = ()) -> str:
    """Plot (step, loss) points to ``path``; return which renderer drew it."""
    if not train and not val:
        raise ValueError("write_loss_png: nothing to plot")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _fallback(path, train, val)
        return "built-in"
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    if train:
        ax.plot(*zip(*train), label="train loss")
    if val:
        ax.plot(*zip(*val), "s", color="tab:red", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/char)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return "matplotlib"
