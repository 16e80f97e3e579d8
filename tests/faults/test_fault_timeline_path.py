"""A timeline this rank cannot write is refused when it starts, naming where the path
came from; one that fails when written at the end does not stop the teardown.

``TANDEM_TIMELINE`` under a regular file once passed init, and then
``destroy_process_group`` raised ``FileExistsError`` halfway, its groups left open.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from typing import Any

import pytest
import torch

import tandem as dist
from _fault_helpers import attempt, values
from tandem.testing import launch, wait_until

pytestmark = [pytest.mark.procs, pytest.mark.timeout(90)]


def _init_under_a_file(rank: int, world_size: int, tmp: str) -> Any:
    os.environ["TANDEM_TIMELINE"] = os.path.join(tmp, "a-file", "trace.json")
    outcome = attempt(dist.init_process_group, "auto", init_method=f"file://{tmp}/store",
                      rank=rank, world_size=world_size)
    outcome["initialized"] = dist.is_initialized()

    def threads() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith("tandem")]

    # the watchdog's thread, started early to overlap the set-up, ends on its own
    outcome["threads_ended"] = attempt(wait_until, lambda: not threads(),
                                       "tandem's threads to end", 10)["ok"]
    outcome["threads"] = threads()
    return outcome


def test_a_timeline_setting_this_rank_cannot_write_is_refused_at_init(tmp_path: Any) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    outcomes = launch(2, _init_under_a_file, (str(tmp_path),), init=False, timeout=60)
    for rank, r in values(outcomes, [0, 1]).items():
        assert not r["ok"] and r["type"] == "ArgumentError", (rank, r)
        assert f"TANDEM_TIMELINE='{tmp_path}/a-file/trace.json': rank {rank} cannot write" \
            in r["msg"], (rank, r)
        assert not r["initialized"] and r["threads_ended"], (rank, r)


def _context_under_a_file(rank: int, world_size: int, tmp: str) -> Any:
    def record() -> None:
        with dist.timeline(os.path.join(tmp, "a-file", "trace.json")):
            dist.all_reduce(torch.ones(4))

    return attempt(record)


def test_a_timeline_path_this_rank_cannot_write_is_refused_when_it_starts(
        tmp_path: Any) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    outcomes = launch(2, _context_under_a_file, (str(tmp_path),), timeout=60)
    for rank, r in values(outcomes, [0, 1]).items():
        assert not r["ok"] and r["type"] == "ArgumentError", (rank, r)
        assert "tandem.timeline: path=" in r["msg"] and "cannot write" in r["msg"], (rank, r)


def _folder_gone_at_the_end(rank: int, world_size: int, tmp: str) -> Any:
    folder = os.path.join(tmp, f"timeline{rank}")
    os.environ["TANDEM_TIMELINE"] = os.path.join(folder, "trace.json")
    dist.init_process_group("auto", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world_size)
    dist.all_reduce(torch.ones(4))
    shutil.rmtree(folder)
    with open(folder, "w") as f:  # the folder is now a file: the write at the end fails
        f.write("in the way")
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("tandem").addHandler(handler)
    outcome = attempt(dist.destroy_process_group)
    outcome["initialized"] = dist.is_initialized()
    outcome["warnings"] = warnings
    return outcome


def test_a_timeline_that_cannot_be_written_at_the_end_does_not_stop_the_teardown(
        tmp_path: Any) -> None:
    outcomes = launch(2, _folder_gone_at_the_end, (str(tmp_path),), init=False, timeout=60)
    for rank, r in values(outcomes, [0, 1]).items():
        assert r["ok"] and not r["initialized"], (rank, r)
        assert any(f"rank {rank} could not write its timeline" in w for w in r["warnings"]), \
            (rank, r)
