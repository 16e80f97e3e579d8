"""A timeline path this rank cannot write is refused when the timeline starts, by creating
the file its end writes: permission bits (``os.access``) say yes to root, on sysfs too."""

from __future__ import annotations

import os

import pytest

from tandem._files import check_creatable
from tandem.collectives.timeline import Timeline
from tandem.errors import ArgumentError


@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="needs sysfs")
def test_a_folder_where_no_file_can_be_made_is_refused_even_for_root() -> None:
    # sysfs folders have mode rwx for root (os.access: yes), yet no file can be made there
    with pytest.raises(ArgumentError, match=r"TANDEM_TIMELINE='/sys/kernel/tl.json': rank 0 "
                                            r"cannot write its timeline"):
        Timeline("/sys/kernel/tl.json", 0).check_writable("TANDEM_TIMELINE")


def test_a_rank_file_that_is_a_directory_is_refused(tmp_path) -> None:
    timeline = Timeline(str(tmp_path / "tl.json"), 0)
    os.makedirs(timeline.rank_path)
    with pytest.raises(ArgumentError, match="is a directory"):
        timeline.check_writable("TANDEM_TIMELINE")


def test_a_writable_folder_passes_and_is_left_as_it_was(tmp_path) -> None:
    Timeline(str(tmp_path / "sub" / "tl.json"), 3).check_writable("TANDEM_TIMELINE")
    assert os.listdir(tmp_path / "sub") == []


def test_the_probe_keeps_a_file_that_was_there(tmp_path) -> None:
    (tmp_path / "kept").write_text("mine")
    check_creatable(str(tmp_path), "kept")
    assert (tmp_path / "kept").read_text() == "mine"
    check_creatable(str(tmp_path))
    assert os.listdir(tmp_path) == ["kept"]
