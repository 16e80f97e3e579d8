"""The Store contract, written once and run on every store.

Each store kind gives two handles onto the same data (``a`` and ``b``): two clients
of one TCPStore server, two FileStore instances on one file, one HashStore twice.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

from tandem.errors import ArgumentError, StoreTimeoutError
from tandem.store import FileStore, HashStore, PrefixStore, Store, TCPStore

Pair = tuple[Store, Store]
TIMEOUT = 5.0  # no test below should need to wait this long


def _hash(tmp: Path) -> Pair:
    store = HashStore(TIMEOUT)
    return store, store


def _file(tmp: Path) -> Pair:
    path = tmp / "store"
    return FileStore(path, timeout=TIMEOUT), FileStore(path, timeout=TIMEOUT)


def _tcp(tmp: Path) -> Pair:
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=TIMEOUT)
    return master, TCPStore("127.0.0.1", master.port, timeout=TIMEOUT)


def _prefixed(make: Callable[[Path], Pair]) -> Callable[[Path], Pair]:
    def make_prefixed(tmp: Path) -> Pair:
        a, b = make(tmp)
        return PrefixStore("job", a), PrefixStore("job", b)

    return make_prefixed


KINDS = {
    "hash": _hash,
    "file": _file,
    "tcp": _tcp,
    "prefix-hash": _prefixed(_hash),
    "prefix-tcp": _prefixed(_tcp),
}


@pytest.fixture(params=list(KINDS))
def pair(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Pair]:
    a, b = KINDS[request.param](tmp_path)
    yield a, b
    # close b first: on TCP, a is the master and closing it stops the server
    for store in (b, a):
        store.close()
        if isinstance(store, PrefixStore):
            store.underlying_store.close()


@pytest.fixture
def store(pair: Pair) -> Store:
    return pair[0]


def _in_thread(fn: Callable[[], None], delay: float) -> threading.Thread:
    def run() -> None:
        time.sleep(delay)
        fn()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_set_then_get_returns_bytes_for_bytes_and_str(pair: Pair) -> None:
    a, b = pair
    a.set("bytes", b"value")
    a.set("text", "välue")
    assert b.get("bytes") == b"value"
    assert b.get("text") == "välue".encode()


def test_set_overwrites(store: Store) -> None:
    store.set("k", b"one")
    store.set("k", b"two")
    assert store.get("k") == b"two"


def test_binary_values_with_nul_bytes_round_trip(pair: Pair) -> None:
    a, b = pair
    value = bytes(range(256)) * 3 + b"\x00\x00"
    a.set("bin", value)
    a.set("empty", b"")
    assert b.get("bin") == value
    assert b.get("empty") == b""


@pytest.mark.procs
def test_get_waits_for_a_later_set_from_another_thread(pair: Pair) -> None:
    a, b = pair
    writer = _in_thread(lambda: b.set("late", b"here"), delay=0.2)
    start = time.monotonic()
    assert a.get("late") == b"here"
    assert time.monotonic() - start >= 0.1
    writer.join(TIMEOUT)


@pytest.mark.procs
def test_blocked_get_does_not_block_a_set_through_the_same_handle(store: Store) -> None:
    writer = _in_thread(lambda: store.set("same", b"handle"), delay=0.2)
    assert store.get("same") == b"handle"
    writer.join(TIMEOUT)


def test_get_timeout_raises_store_timeout_error_naming_the_key(store: Store) -> None:
    store.set_timeout(0.2)
    start = time.monotonic()
    with pytest.raises(StoreTimeoutError, match="never-set"):
        store.get("never-set")
    assert 0.15 <= time.monotonic() - start < 5.0


def test_add_returns_running_total_and_get_reads_decimal_text(pair: Pair) -> None:
    a, b = pair
    assert a.add("n", 3) == 3
    assert b.add("n", 4) == 7
    assert a.add("n", -10) == -3
    assert b.get("n") == b"-3"


def test_add_to_a_non_integer_value_raises_argument_error(store: Store) -> None:
    store.set("word", b"abc")
    with pytest.raises(ArgumentError, match="integer"):
        store.add("word", 1)


def test_compare_set_on_missing_key_with_empty_expected_sets(pair: Pair) -> None:
    a, b = pair
    assert a.compare_set("cas", b"", b"first") == b"first"
    assert b.get("cas") == b"first"


def test_compare_set_on_missing_key_with_nonempty_expected_returns_expected(store: Store) -> None:
    assert store.compare_set("cas", b"guess", b"new") == b"guess"
    assert not store.check(["cas"])


def test_compare_set_with_matching_expected_sets(store: Store) -> None:
    store.set("cas", b"old")
    assert store.compare_set("cas", b"old", b"new") == b"new"
    assert store.get("cas") == b"new"


def test_compare_set_with_mismatching_expected_returns_current(store: Store) -> None:
    store.set("cas", b"current")
    assert store.compare_set("cas", b"other", b"new") == b"current"
    assert store.get("cas") == b"current"


def test_wait_returns_once_every_key_exists(pair: Pair) -> None:
    a, b = pair
    a.set("w1", b"1")
    waiting, seen = threading.Event(), []

    def waiter() -> None:
        waiting.set()
        a.wait(["w1", "w2"], timeout=TIMEOUT)
        seen.append(a.check(["w2"]))

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    assert waiting.wait(TIMEOUT)
    thread.join(0.3)
    assert thread.is_alive() and not seen, "wait() returned before w2 existed"
    b.set("w2", b"2")
    thread.join(TIMEOUT)
    assert seen == [True]


def test_wait_timeout_names_only_the_missing_keys(store: Store) -> None:
    store.set("present", b"1")
    with pytest.raises(StoreTimeoutError, match="absent") as info:
        store.wait(["present", "absent"], timeout=0.2)
    assert "present" not in str(info.value)


def test_check_is_true_only_when_every_key_exists(store: Store) -> None:
    assert not store.check(["c1"])
    store.set("c1", b"")
    assert store.check(["c1"])
    assert not store.check(["c1", "c2"])


def test_delete_key_returns_whether_the_key_existed(pair: Pair) -> None:
    a, b = pair
    a.set("gone", b"x")
    assert b.delete_key("gone") is True
    assert a.delete_key("gone") is False
    assert not a.check(["gone"])


def test_num_keys_counts_sets_and_deletes(store: Store) -> None:
    base = store.num_keys()
    store.set("k1", b"1")
    store.add("k2", 1)
    assert store.num_keys() == base + 2
    store.delete_key("k1")
    assert store.num_keys() == base + 1


def test_multi_set_and_multi_get(pair: Pair) -> None:
    a, b = pair
    a.multi_set(["m1", "m2", "m3"], [b"1", "2", b"\x003"])
    assert b.multi_get(["m3", "m1", "m2"]) == [b"\x003", b"1", b"2"]


@pytest.mark.procs
def test_multi_get_waits_for_every_key_to_appear(pair: Pair) -> None:
    a, b = pair
    a.set("early", b"1")
    writer = _in_thread(lambda: a.multi_set(["late1", "late2"], [b"2", b"3"]), delay=0.2)
    assert b.multi_get(["early", "late1", "late2"]) == [b"1", b"2", b"3"]
    writer.join(TIMEOUT)


def test_multi_get_timeout_names_only_the_missing_keys(store: Store) -> None:
    store.set("here", b"1")
    store.set_timeout(0.2)
    with pytest.raises(StoreTimeoutError, match="gone") as info:
        store.multi_get(["here", "gone"])
    assert "here" not in str(info.value)


def test_multi_ops_on_no_keys_do_nothing(store: Store) -> None:
    store.multi_set([], [])
    assert store.multi_get([]) == []


def test_multi_get_refuses_a_single_str(store: Store) -> None:
    with pytest.raises(ArgumentError, match="list of keys"):
        store.multi_get("key")  # type: ignore[arg-type]


def test_multi_set_with_unequal_lengths_raises_argument_error(store: Store) -> None:
    with pytest.raises(ArgumentError):
        store.multi_set(["a", "b"], [b"1"])


def _race(pair: Pair, threads_n: int, times: int, call: Callable[[Store], object]) -> None:
    """``call(handle)`` ``times`` times in each of ``threads_n`` threads released at once,
    the threads alternating between the pair's two handles; none may raise."""
    barrier = threading.Barrier(threads_n)
    errors: list[BaseException] = []

    def work(handle: Store) -> None:
        try:
            barrier.wait(TIMEOUT)
            for _ in range(times):
                call(handle)
        except BaseException as exc:  # reported below with the thread's store
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(pair[i % 2],), daemon=True)
               for i in range(threads_n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    assert not errors


def test_concurrent_adds_from_32_threads_sum_correctly(pair: Pair) -> None:
    _race(pair, 32, 10, lambda handle: handle.add("total", 1))
    assert pair[0].get("total") == str(32 * 10).encode()


def test_append_creates_a_missing_key_then_concatenates(pair: Pair) -> None:
    a, b = pair
    a.append("log", b"x\x00")
    b.append("log", "y")
    assert a.get("log") == b"x\x00y"
    assert a.has_extended_api()


def test_concurrent_appends_of_the_same_bytes_are_all_kept(pair: Pair) -> None:
    # identical appends racing on a missing key: each must land, none may be taken for
    # another's (16 threads, 5 appends each, so 80 bytes)
    _race(pair, 16, 5, lambda handle: handle.append("same", b"z"))
    assert pair[0].get("same") == b"z" * (16 * 5)


def test_a_key_or_value_that_is_not_utf8_text_is_refused_by_every_store(store: Store) -> None:
    # HashStore took a lone surrogate; FileStore and TCPStore failed in str.encode
    for call in (lambda: store.set("\udc80", b"x"), lambda: store.set("k", "\udc80"),
                 lambda: store.get("\udc80"), lambda: store.add("\ud800", 1),
                 lambda: store.multi_set(["k", "\udc80"], [b"1", b"2"])):
        with pytest.raises(ArgumentError, match="not valid UTF-8 text"):
            call()
    assert not store.check(["k"])  # nothing half-written


@pytest.mark.parametrize("value", [[300], [-1], (0, 256)])
def test_a_value_list_with_an_int_outside_a_byte_is_refused(store: Store, value: object) -> None:
    with pytest.raises(ArgumentError, match="byte values 0..255"):
        store.set("k", value)  # type: ignore[arg-type]


@pytest.mark.parametrize("amount", [1 << 63, -(1 << 63) - 1, 10 ** 5000],
                         ids=["2**63", "-2**63-1", "10**5000"])
def test_an_add_amount_outside_int64_is_refused_naming_the_range(
        store: Store, amount: int) -> None:
    # 10**5000 failed with Python's "Exceeds the limit (4300 digits)" ValueError
    with pytest.raises(ArgumentError, match="outside a 64-bit counter's range"):
        store.add("c", amount)
    assert store.add("c", (1 << 63) - 1) == (1 << 63) - 1


def test_a_timeout_on_many_or_huge_keys_names_a_few_of_them_briefly(store: Store) -> None:
    # the message named every key in full: megabytes for a wait on a million keys
    keys = [f"k{i}" for i in range(10_000)] + ["x" * 100_000]
    with pytest.raises(StoreTimeoutError) as info:
        store.wait(keys, 0.05)
    message = str(info.value)
    assert len(message) < 5_000 and "k0', '" in message, message[:300]
    assert "and 9985 more" in message
    with pytest.raises(StoreTimeoutError) as info:
        store.get("y" * 100_000)
    assert len(str(info.value)) < 1_000 and "yyy..." in str(info.value)
