"""Every environment variable an init reads, given a wrong value, is named in the error
with its value and what it must be: ``MASTER_PORT=70000`` said only "port must be
1..65535", and ``SLURM_PROCID=abc`` blamed ``RANK``, a variable the user never set."""

from __future__ import annotations

import re

import pytest

import tandem
from tandem.collectives.init_method import open_store
from tandem.errors import ArgumentError, TandemError
from tandem.store.tcp import TCPStore

# rank 1 never serves the store, and port 1 refuses: a value let through is a network
# error or a timeout here, never an ArgumentError
_BASE = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "RANK": "1", "WORLD_SIZE": "2"}
_SLURM = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1",
          "SLURM_NODEID": "0", "SLURM_NNODES": "1", "SLURM_STEP_TASKS_PER_NODE": "2",
          "SLURM_STEP_NODELIST": "127.0.0.1", "SLURM_JOB_ID": "7"}
_OMPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
         "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
         "OMPI_MCA_ess_base_jobid": "7", "MASTER_ADDR": "127.0.0.1"}
_PMIX = {"PMIX_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
         "MASTER_PORT": "1"}
_PMI = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1"}
_RANKS = ["-1", "abc", "1.5", "2", "70000", "1_0"]  # 2: not below a job size of 2
_SIZES = ["0", "-1", "abc", "1.5", "1_0", str(2 ** 40)]
_COUNTS = ["-1", "abc", "1.5", str(2 ** 40)]  # unset or empty: not given
_PORT = ["70000", "-1", "abc", "", "1.5", "65536", "0"]  # 0 only on rank 0

# (variable, the environment it is wrong in, its wrong values)
_CASES: list[tuple[str, dict[str, str], list[str]]] = [
    ("MASTER_PORT", _BASE, _PORT),
    ("MASTER_ADDR", _BASE, ["", "  "]),
    ("RANK", _BASE, _RANKS + [""]),
    ("WORLD_SIZE", {**_BASE, "RANK": "0"}, _SIZES + [""]),
    ("LOCAL_RANK", _BASE, _COUNTS),
    ("LOCAL_WORLD_SIZE", _BASE, _COUNTS + ["0"]),
    ("GROUP_RANK", _BASE, _COUNTS),
    ("GROUP_WORLD_SIZE", _BASE, _COUNTS + ["0"]),
    ("SLURM_PROCID", _SLURM, _RANKS + [""]),
    ("SLURM_NTASKS", {**_SLURM, "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}, _SIZES + [""]),
    ("SLURM_LOCALID", _SLURM, _RANKS),
    ("SLURM_NNODES", _SLURM, ["0", "-1", "abc", "1.5", "3"]),  # 3 nodes for 2 tasks
    ("SLURM_NODEID", _SLURM, ["-1", "abc", "1.5", "1"]),  # 1: the step has one node
    ("SLURM_STEP_TASKS_PER_NODE", _SLURM, ["abc", "1.5", "2(x"]),
    ("SLURM_JOB_ID", _SLURM, ["abc", "-1", "1.5", ""]),
    ("OMPI_COMM_WORLD_RANK", _OMPI, _RANKS + [""]),
    ("OMPI_COMM_WORLD_SIZE", {**_OMPI, "OMPI_COMM_WORLD_RANK": "0",
                              "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                              "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}, _SIZES + [""]),
    ("OMPI_COMM_WORLD_LOCAL_RANK", _OMPI, _RANKS),
    ("OMPI_COMM_WORLD_LOCAL_SIZE", _OMPI, ["0", "-1", "abc", "1.5", "3"]),
    ("OMPI_MCA_ess_base_jobid", _OMPI, ["abc", "-1", "1.5", ""]),
    ("PMIX_RANK", _PMIX, _RANKS + [""]),
    ("PMI_RANK", _PMI, _RANKS + [""]),
    ("PMI_SIZE", {**_PMI, "PMI_RANK": "0", "MPI_LOCALRANKID": "0"}, _SIZES + [""]),
    ("MPI_LOCALRANKID", _PMI, _RANKS),
]


@pytest.mark.parametrize("name,env,value", [
    pytest.param(name, env, value, id=f"{name}={value!r}")
    for name, env, values in _CASES for value in values])
def test_a_wrong_environment_value_is_named_with_its_value_and_what_is_expected(
        name: str, env: dict[str, str], value: str) -> None:
    given = {**env, name: value}
    with pytest.raises(ArgumentError) as caught:
        open_store("env://", -1, -1, 5.0, 2.0, given)
    text = str(caught.value)
    assert f"{name}={value!r}" in text, text  # the variable, with the value it holds
    assert re.search(r"expected \S", text), text  # and what it must hold


def test_the_outsiders_case_through_init_process_group(
        job_secret: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {**_BASE, "MASTER_PORT": "70000"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ArgumentError, match=r"MASTER_PORT='70000' is out of range: expected "
                                            r"a TCP port, 1\.\.65535"):
        tandem.init_process_group("tcp", init_method="env://")
    assert not tandem.is_initialized()


@pytest.mark.parametrize("port", ["70000", "abc", "-1"])
def test_a_wrong_port_in_a_tcp_url_is_an_argument_error_naming_the_url(port: str) -> None:
    url = f"tcp://127.0.0.1:{port}?rank=1&world_size=2"
    with pytest.raises(ArgumentError, match=re.escape(url)):
        open_store(url, -1, -1, 5.0, 2.0, {})


@pytest.mark.parametrize("env", [
    {**_BASE, "RANK": "0", "MASTER_PORT": "0"},  # rank 0 may serve on any free port
    {**_BASE, "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "1", "RANK": "0",
     "MASTER_PORT": "0"},  # an in-place spare of tandemrun: checked each alone
    {**_BASE, "LOCAL_RANK": "", "GROUP_RANK": "", "RANK": " 1 "},  # empty is unset
], ids=["port-0-on-rank-0", "in-place-spare", "empty-and-spaces"])
def test_values_that_are_right_pass_the_checks(env: dict[str, str]) -> None:
    try:
        store, rank, size, _ = open_store("env://", -1, -1, 5.0, 2.0, env)
    except TandemError as exc:  # past the checks, port 1 refuses rank 1; else it is named
        assert not isinstance(exc, ArgumentError), exc
        return
    store.close()
    assert (rank, size) == (int(env["RANK"]), int(env["WORLD_SIZE"]))


@pytest.mark.parametrize("value", ["-1", "abc", "1.5", "", str(2 ** 40)])
def test_get_node_local_rank_names_a_wrong_local_rank(
        value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", value)
    with pytest.raises(ArgumentError) as caught:
        tandem.get_node_local_rank(fallback_rank=0)
    assert f"LOCAL_RANK={value!r}" in str(caught.value) and "expected" in str(caught.value)


@pytest.mark.parametrize("port", [70000, -1])
def test_a_tcp_store_names_itself_in_a_wrong_port(port: int) -> None:
    with pytest.raises(ArgumentError, match=rf"TCPStore: port must be .*1\.\.65535.*{port}"):
        TCPStore("127.0.0.1", port, 1, is_master=False)


_SETTINGS = sorted(set(re.findall(r'_number\(env, "(TANDEM_[A-Z_]+)"',
                                  open(tandem.config.__file__).read())))


@pytest.mark.parametrize("name", _SETTINGS)
@pytest.mark.parametrize("value", ["abc", "-1", "1e400", "1.5x"])
def test_a_wrong_tandem_setting_is_named(name: str, value: str) -> None:
    # the TANDEM_* numbers init reads: a guard, these were named already
    try:
        tandem.config.load_settings({name: value})
    except ArgumentError as exc:
        assert name in str(exc), exc
    else:
        assert value == "-1", f"{name}={value!r} was taken"  # -1: "off" for some settings


@pytest.mark.parametrize("scheme", ["tcp://127.0.0.1:1", "file:///nonexistent/tandem-store",
                                    "env://"])
@pytest.mark.parametrize("query,key", [
    ("rank=-1&world_size=2", "rank"), ("rank=1&world_size=-1", "world_size"),
    ("rank=abc&world_size=2", "rank"), ("rank=&world_size=2", "rank"),
    ("rank=1&world_size=", "world_size"), ("rank=1_0&world_size=20", "rank"),
    ("rank=1&world_size=0", "world_size"), (f"rank=1&world_size={2 ** 40}", "world_size"),
    ("rank=1&rank=0&world_size=2", "rank")])
def test_a_wrong_rank_or_world_size_in_the_url_is_named_not_read_as_unset(
        scheme: str, query: str, key: str) -> None:
    # rank=-1 was read as unset: the error said the URL needs rank= and world_size=
    url = f"{scheme}?{query}"
    with pytest.raises(ArgumentError, match=re.escape(f"init_method {url!r}") + f".*{key}="):
        open_store(url, -1, -1, 5.0, 2.0, _BASE)


@pytest.mark.parametrize("scheme", ["tcp://127.0.0.1:1?world_size=2&rank=1",
                                    "file:///nonexistent/tandem-store?world_size=2&rank=1",
                                    "env://"])
@pytest.mark.parametrize("rank,world_size,name", [
    (-5, 2, "rank"), (1, -3, "world_size"), ("1", 2, "rank"), (1, 2.0, "world_size"),
    (True, 2, "rank")])
def test_a_wrong_rank_or_world_size_argument_is_named_not_read_as_unset(
        scheme: str, rank: object, world_size: object, name: str) -> None:
    # rank=-5 was read as the default -1, and rank="1" was a TypeError from a comparison
    with pytest.raises(ArgumentError, match=f"^{name}="):
        open_store(scheme, rank, world_size, 5.0, 2.0, _BASE)  # type: ignore[arg-type]
