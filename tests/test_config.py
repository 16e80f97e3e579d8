"""Settings and timeouts: every value is checked where it enters, with a message naming it.

A deadline that is NaN or infinite is no deadline at all (NaN compares false with
everything, so a wait loop on it never ends and spins); one that is negative has already
passed. Both are refused, in every spelling the API accepts (seconds, ``timedelta``,
environment variables).
"""

from __future__ import annotations

import datetime
import math

import pytest

from tandem.config import Settings, load_settings, timeout_seconds
from tandem.errors import ArgumentError

BAD_SECONDS = [math.nan, math.inf, -math.inf, -1.0, 0, 0.0, 1e300]


@pytest.mark.parametrize("value", BAD_SECONDS, ids=str)
def test_timeout_in_seconds_that_is_not_a_finite_positive_number_is_refused(value: float) -> None:
    with pytest.raises(ArgumentError, match="timeout"):
        timeout_seconds(value, 5.0)


@pytest.mark.parametrize("value", [datetime.timedelta(seconds=-1), datetime.timedelta(0),
                                   datetime.timedelta.max], ids=str)
def test_timedelta_that_is_not_positive_and_bounded_is_refused(value: datetime.timedelta) -> None:
    with pytest.raises(ArgumentError, match="timeout"):
        timeout_seconds(value, 5.0)


@pytest.mark.parametrize("value", ["30", True, [1.0]], ids=repr)
def test_timeout_of_the_wrong_type_is_refused_naming_the_type(value: object) -> None:
    with pytest.raises(ArgumentError, match=type(value).__name__):
        timeout_seconds(value, 5.0)  # type: ignore[arg-type]


def test_timeout_accepts_seconds_and_timedelta_and_none_means_the_default() -> None:
    assert timeout_seconds(None, 7.0) == 7.0
    assert timeout_seconds(2, 7.0) == 2.0
    assert timeout_seconds(0.25, 7.0) == 0.25
    assert timeout_seconds(datetime.timedelta(minutes=2), 7.0) == 120.0


def test_the_argument_name_appears_in_the_message() -> None:
    with pytest.raises(ArgumentError, match=r"barrier: timeout must be"):
        timeout_seconds(math.nan, 5.0, "barrier: timeout")


@pytest.mark.parametrize("name", ["TANDEM_TIMEOUT", "TANDEM_CONNECT_TIMEOUT"])
@pytest.mark.parametrize("raw", ["nan", "NaN", "inf", "-inf", "-5", "0", "1e400"])
def test_timeout_settings_that_are_not_finite_positive_are_refused(name: str, raw: str) -> None:
    with pytest.raises(ArgumentError, match=name):
        load_settings({name: raw})


@pytest.mark.parametrize("field", ["timeout", "connect_timeout"])
def test_settings_built_directly_refuse_nan(field: str) -> None:
    with pytest.raises(ArgumentError, match="TANDEM_"):
        Settings(**{field: math.nan})  # type: ignore[arg-type]


@pytest.mark.parametrize("raw,expected", [("1", True), ("true", True), ("yes", True),
                                          ("on", True), ("0", False), ("false", False),
                                          ("False", False), ("no", False), ("off", False),
                                          ("", False)])
def test_debug_flag_reads_the_usual_spellings(raw: str, expected: bool) -> None:
    assert load_settings({"TANDEM_DEBUG": raw}).debug is expected


def test_a_flag_that_is_neither_true_nor_false_is_refused() -> None:
    with pytest.raises(ArgumentError, match="TANDEM_SHM_ARENA='maybe'"):
        load_settings({"TANDEM_SHM_ARENA": "maybe"})


def test_host_id_and_local_world_size_are_settings() -> None:
    s = load_settings({"TANDEM_HOST_ID": "node-a", "LOCAL_WORLD_SIZE": "4"})
    assert (s.host_id, s.local_world_size) == ("node-a", 4)
    unset = load_settings({})
    assert (unset.host_id, unset.local_world_size) == (None, None)


@pytest.mark.parametrize("raw", ["0", "-2", "four"])
def test_local_world_size_must_be_a_positive_integer(raw: str) -> None:
    with pytest.raises(ArgumentError, match="LOCAL_WORLD_SIZE"):
        load_settings({"LOCAL_WORLD_SIZE": raw})


def test_only_tandem_config_reads_settings_from_the_environment() -> None:
    """Settings are read once, into Settings, and passed down (the launcher and the
    benchmarks, which read their own command-line environment, aside)."""
    import re
    from pathlib import Path

    import tandem

    root = Path(tandem.__file__).parent
    reads = re.compile(r"(environ|getenv)\W[^\n]*[\"'](TANDEM_|LOCAL_WORLD_SIZE)")
    outside = [
        f"{path.relative_to(root)}:{number}: {line.strip()}"
        for path in sorted(root.rglob("*.py"))
        if path.name != "config.py" and path.relative_to(root).parts[0] not in ("run", "bench")
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if reads.search(line)
    ]
    assert not outside, "settings read outside tandem.config:\n" + "\n".join(outside)


def test_the_settings_page_lists_every_setting_config_reads_and_no_other() -> None:
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    read = set(re.findall(r'"((?:TANDEM_[A-Z_]+)|LOCAL_WORLD_SIZE)"', (root / "tandem" / "config.py").read_text()))
    listed = set(re.findall(r"^\| `([A-Z_]+)` \|", (root / "docs" / "settings.md").read_text(), re.M))
    assert read, "found no setting read in tandem/config.py"
    assert read - listed == set(), f"docs/settings.md lacks {sorted(read - listed)}"
    assert listed - read == set(), f"docs/settings.md lists settings config.py does not read: {sorted(listed - read)}"


def test_a_count_of_one_takes_the_singular() -> None:
    from tandem._words import counted
    assert [counted(n, "rank") for n in (0, 1, 2)] == ["0 ranks", "1 rank", "2 ranks"]
    assert counted(1, "process", "processes") == "1 process"
    assert counted(4, "process", "processes") == "4 processes"
    import torch

    from tandem.collectives.checks import tensors_arg
    from tandem.errors import ArgumentError
    t = torch.zeros(2)
    with pytest.raises(ArgumentError, match="has 2 tensors; the group has 1 rank$"):
        tensors_arg([t, t], "all_gather", "tensor_list", 1, torch.float32)
