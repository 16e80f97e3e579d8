"""What a rank sent before it left is delivered; a message to a rank that left completes.

Rings are made on a pair's first message, so a rank's last message may be the one that
makes its ring, and its peer may answer a rank that has already gone. A rank that
sends and leaves at once (the message's ring made by it, one frame, streamed through
the ring, or read by reference): its peer reads every byte, whether its receive was
posted before or after the sender left, and counts it as left, not crashed. A send to
a rank that said goodbye completes (nobody will read it, as with a message written into
its ring after it left) instead of failing the caller: a gather's root announcing
itself to a member that already finished and left, as ``consolidate_state_dict(to=0)``
did at the end of a ZeRO script, failed with "rank 1 ... closed its shared-memory
connection to rank 0".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import _shm_leave_ranks as ranks
from tandem.testing import Outcome, launch
from tandem.transport.shm import unsupported_reason

pytestmark = [pytest.mark.procs, pytest.mark.timeout(300),
              pytest.mark.skipif(bool(unsupported_reason()), reason=unsupported_reason())]


def _values(outcomes: list[Outcome]) -> list[Any]:
    bad = [o for o in outcomes if not o.ok]
    assert not bad, "\n".join(f"--- rank {o.rank} ({o.error_type}) ---\n{o.error}" for o in bad)
    return [o.value for o in outcomes]


def test_what_a_rank_sent_before_leaving_arrives_and_a_reply_to_it_completes(
        tmp_path: Path) -> None:
    rounds = 4 * len(ranks.SIZES)  # each size, receive posted before and after, twice
    outcomes = launch(2, ranks.send_then_leave, (str(tmp_path / "store"), rounds),
                      init=False, timeout=240)
    problems = {rank: seen for rank, seen in enumerate(_values(outcomes)) if seen}
    assert not problems, problems


def test_a_gather_root_after_a_member_left_gets_every_part(tmp_path: Path) -> None:
    outcomes = launch(2, ranks.gather_after_a_member_left, (str(tmp_path / "left"),),
                      backend="shm", timeout=120)
    assert _values(outcomes)[0] == [[0.0] * 3, [1.0] * 3], outcomes[0].value
