"""SLURM's hostlist syntax: ``node[1-3,7],gpu[01-02]`` -> node1 node2 node3 node7 gpu01 gpu02.

The grammar is SLURM's own (``scontrol show hostnames`` is the reference):

* names are separated by commas outside brackets;
* a bracket holds comma-separated numbers and ``LO-HI`` ranges; ``LO``'s width is kept
  (``[08-10]`` -> ``08 09 10``);
* a name may hold several brackets (``rack[1-2]-n[1-2]``); they expand as nested loops,
  the last bracket fastest, as SLURM lists them.
"""

from __future__ import annotations

import re

from tandem.errors import ArgumentError

__all__ = ["expand_hostlist"]

# a list longer than this is almost certainly a typo ("node[1-100000000]")
_MAX_HOSTS = 1_000_000
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def _split_top(text: str, whole: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ArgumentError(f"hostlist {whole!r}: nested '[' at character {i}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ArgumentError(f"hostlist {whole!r}: ']' without '[' at character {i}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ArgumentError(f"hostlist {whole!r}: '[' is never closed")
    parts.append(text[start:])
    return parts


def _numbers(spec: str, whole: str) -> list[str]:
    out: list[str] = []
    for item in spec.split(","):
        m = _RANGE.fullmatch(item.strip())
        if m is None:
            raise ArgumentError(f"hostlist {whole!r}: {item!r} in [{spec}] is neither a "
                                f"number nor a range LO-HI")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise ArgumentError(f"hostlist {whole!r}: range {item!r} runs backwards")
        if int(hi) - int(lo) >= _MAX_HOSTS:
            raise ArgumentError(f"hostlist {whole!r}: range {item!r} names more than "
                                f"{_MAX_HOSTS} hosts")
        out.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return out


def expand_hostlist(text: str) -> list[str]:
    """Every host name of a SLURM hostlist, in SLURM's order; ``ArgumentError`` on bad syntax."""
    hosts: list[str] = []
    for part in _split_top(text.strip(), text):
        part = part.strip()
        if not part:
            continue  # "a,,b" and a trailing comma name no host, as in SLURM
        names = [""]
        for m in re.finditer(r"([^\[]*)(?:\[([^\]]*)\])?", part):
            literal, bracket = m.group(1), m.group(2)
            names = [n + literal for n in names]
            if bracket is not None:
                names = [n + num for n in names for num in _numbers(bracket, text)]
            if len(hosts) + len(names) > _MAX_HOSTS:
                raise ArgumentError(f"hostlist {text!r} names more than {_MAX_HOSTS} hosts")
        hosts.extend(names)
    if not hosts:
        raise ArgumentError(f"hostlist {text!r} names no host")
    return hosts
