"""The rendezvous under torch: tandem's authenticated store when the job secret is given.

torch's TCPStore has no authentication; ``tandem.torch_backend`` serves ``tandem://``,
and ``env://``/``tcp://`` whenever ``TANDEM_SECRET`` (or ``TANDEM_SECRET_FILE``) is set,
through :class:`~tandem.torch_backend.AuthenticatedStore`, tandem's TCPStore behind
torch's ``Store`` interface.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tandem.torch_backend  # noqa: F401 - registers the backend and the rendezvous
from tandem.errors import ArgumentError, AuthenticationError
from tandem.torch_backend import AuthenticatedStore
from tandem.torch_backend import _auth_store

from _tb_util import env, values

pytestmark = pytest.mark.timeout(120)


def _store_of(url: str) -> Any:
    store, rank, size = next(dist.rendezvous(url, rank=0, world_size=1))
    assert (rank, size) == (0, 1)
    return store


@pytest.mark.parametrize("url", ["env://", "tcp://127.0.0.1:0", "tandem://127.0.0.1:0"])
def test_a_given_secret_makes_the_rendezvous_authenticated(
        url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "0")
    store = _store_of(url)
    try:
        assert isinstance(store, AuthenticatedStore), type(store)
        store.set("k", b"v")
        assert store.get("k") == b"v" and store.add("n", 2) == 2
    finally:
        store.close()


@pytest.mark.parametrize("url", ["env://", "tcp://127.0.0.1:0"])
def test_without_a_secret_torch_keeps_its_own_store(url: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANDEM_SECRET")
    monkeypatch.delenv("TANDEM_SECRET_FILE", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "0")
    assert isinstance(_store_of(url), dist.TCPStore)


def test_env_without_a_master_address_names_the_variables(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(ValueError, match="MASTER_ADDR and MASTER_PORT are needed"):
        _store_of("env://")


def test_torchruns_agent_store_speaks_torchs_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not _auth_store._torch_protocol()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert _auth_store._torch_protocol()


def test_a_client_without_the_secret_is_refused() -> None:
    server = AuthenticatedStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                timeout=10)
    try:
        with pytest.raises(AuthenticationError):
            AuthenticatedStore("127.0.0.1", server.port, timeout=10, secret=b"not the secret")
    finally:
        server.close()


def test_the_tandem_scheme_runs_a_job(monkeypatch: pytest.MonkeyPatch) -> None:
    dist.init_process_group("tandem", init_method="tandem://127.0.0.1:0", rank=0, world_size=1)
    try:
        t = torch.ones(3)
        dist.all_reduce(t)
        gloo = dist.new_group(backend="gloo")  # gloo's C++ reaches the Python store too
        dist.all_reduce(t, group=gloo)
        assert t.tolist() == [1.0, 1.0, 1.0]
    finally:
        dist.destroy_process_group()


def _two_ranks(rank: int, world: int, port: int) -> list[float]:
    store = AuthenticatedStore("127.0.0.1", port, world, timeout=30)
    dist.init_process_group("tandem", store=store, rank=rank, world_size=world)
    t = torch.full((2,), float(rank + 1))
    dist.all_reduce(t)
    gloo = dist.new_group(backend="gloo")
    dist.all_reduce(t, group=gloo)
    dist.destroy_process_group()
    return t.tolist()


@pytest.mark.procs
def test_two_ranks_rendezvous_through_the_authenticated_store(tmp_path: Path) -> None:
    from tandem.testing import launch

    server = AuthenticatedStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                timeout=30)
    try:
        import os
        outcomes = launch(2, _two_ranks, (server.port,), timeout=90, init=False,
                          env={**env(), "TANDEM_SECRET": os.environ["TANDEM_SECRET"]})
    finally:
        server.close()
    assert values(outcomes) == [[6.0, 6.0], [6.0, 6.0]]


@pytest.mark.parametrize("name,value", [
    ("MASTER_PORT", "70000"), ("MASTER_PORT", "abc"), ("MASTER_PORT", "1.5"),
    ("MASTER_PORT", "-1"), ("RANK", "abc"), ("RANK", "-1"), ("RANK", "1.5"), ("RANK", ""),
    ("WORLD_SIZE", "0"), ("WORLD_SIZE", "abc"), ("WORLD_SIZE", "1.5"), ("WORLD_SIZE", ""),
])
def test_env_values_that_are_wrong_are_named_with_what_is_expected(
        name: str, value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # rank 1 never serves, port 1 refuses: a value let through fails otherwise, and later
    for var, text in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "RANK": "1",
                      "WORLD_SIZE": "2", name: value}.items():
        monkeypatch.setenv(var, text)
    with pytest.raises(ArgumentError) as caught:
        next(dist.rendezvous("env://"))
    assert f"{name}={value!r}" in str(caught.value) and "expected" in str(caught.value)


def test_a_rank_not_below_the_world_size_names_both_variables(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for var, text in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "RANK": "2",
                      "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(var, text)
    with pytest.raises(ArgumentError, match=r"rank 2 is not below the world size 2 .*RANK and "
                                            r"WORLD_SIZE"):
        next(dist.rendezvous("env://"))


@pytest.mark.parametrize("url", ["tcp://127.0.0.1:70000", "tandem://127.0.0.1:abc"])
def test_a_wrong_port_in_the_url_is_named(url: str) -> None:
    with pytest.raises(ArgumentError, match="the port of .* must be an integer, 1..65535"):
        next(dist.rendezvous(url, rank=1, world_size=2))
