"""The collectives layer uses the transport through its public surface only.

``tandem.transport`` exports what upper layers need (the ``Transport`` seam, the
message types, ``Arena``); its ``_private`` modules and the mailbox's bookkeeping
stay inside it, so the transport can change them without touching the layers above.
"""

from __future__ import annotations

import enum
import re
from pathlib import Path

import tandem.transport as transport
from tandem.transport import Kind, Transport

ROOT = Path(transport.__file__).resolve().parent.parent
ABOVE = [p for p in ROOT.rglob("*.py") if "transport" not in p.relative_to(ROOT).parts]


def test_no_module_above_the_transport_imports_its_private_modules() -> None:
    offenders = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in ABOVE
                 for m in re.finditer(r"tandem\.transport\._\w+", p.read_text())]
    assert not offenders, offenders


def test_no_module_above_the_transport_reads_the_mailbox() -> None:
    offenders = [f"{p.relative_to(ROOT)}:{i}" for p in ABOVE
                 for i, line in enumerate(p.read_text().splitlines(), 1)
                 if re.search(r"\bmailbox\.\w+", line)]
    assert not offenders, offenders


def test_kind_is_an_int_enum_that_frames_as_one_byte() -> None:
    assert issubclass(Kind, enum.IntEnum)
    assert [int(k) for k in Kind] == [1, 2, 3, 4, 5, 6]
    assert all(0 < k < 256 for k in Kind)


def test_the_transport_seam_offers_what_collectives_need() -> None:
    for name in ("isend", "irecv", "irecv_any", "cancel", "wait", "aborted", "lost", "left",
                 "finished", "parked_call", "abort", "fail_here", "close", "arena",
                 "shares_memory_with", "host_of"):
        assert callable(getattr(Transport, name, None)), name
    assert {"Transport", "Header", "Kind", "Slot", "Arena"} <= set(transport.__all__)
