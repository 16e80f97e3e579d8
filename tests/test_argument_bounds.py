"""Every size-like public argument has an upper bound, checked before anything is made.

The companion of ``test_config_bounds.py`` (settings): ``tandemrun --spares 100000``
forked spares until the launcher could start no thread and died, and
``DistributedSampler(data, num_replicas=2**40)`` ran out of memory. The table holds
every bounded argument; each refusal names the argument, its value and the limit.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from test_config_bounds import assert_names
from tandem.config import MAX_WORLD_SIZE, memory_limit, shm_chunk_limit
from tandem.errors import ArgumentError


class _Sized:
    def __len__(self) -> int:
        return 10


def _sampler(replicas: int) -> object:
    from tandem.parallel import DistributedSampler

    return DistributedSampler(_Sized(), num_replicas=replicas, rank=0)


def _ddp(cap_mb: float) -> object:
    from tandem.parallel import DistributedDataParallel

    return DistributedDataParallel(torch.nn.Linear(2, 2), bucket_cap_mb=cap_mb)


def _rpc_threads(n: int) -> object:
    from tandem.rpc import TensorPipeRpcBackendOptions

    return TensorPipeRpcBackendOptions(num_worker_threads=n)


def _launch(**kw: Any) -> object:
    from tandem.run.config import LaunchConfig

    return LaunchConfig(entrypoint="train.py", **kw)


def _tcp_store(n: int) -> object:
    from tandem.store import TCPStore

    return TCPStore("127.0.0.1", 0, world_size=n, is_master=True, secret=b"x")


def _file_store(tmp: str, n: int) -> object:
    from tandem.store import FileStore

    return FileStore(os.path.join(tmp, "store"), world_size=n)


def _world(n: int) -> object:
    from tandem.collectives.init_method import check_rank

    check_rank(0, n)
    return None


def _ring_bytes(n: int) -> object:
    from tandem.transport.shm import ShmTransport

    return ShmTransport(0, 2, None, b"x", ring_bytes=n)  # type: ignore[arg-type]


def _elastic_sampler(size: int = 10, batch_size: int = 2) -> object:
    from tandem.elastic import ElasticSampler, ElasticState

    return ElasticSampler(size, ElasticState(step=0), batch_size)


def _elastic_state(min_ranks: int) -> object:
    from tandem.elastic import ElasticState

    return ElasticState(min_ranks=min_ranks)


def _fit() -> int:
    from tandem.run.config import workers_that_fit

    return workers_that_fit() or 1


# argument -> (make it with a value, the limit, a value past it)
ARGUMENT_BOUNDS: dict[str, tuple[Callable[..., object], Callable[[], float], float]] = {
    "DistributedSampler: num_replicas": (_sampler, lambda: MAX_WORLD_SIZE, 1 << 40),
    "DistributedDataParallel: bucket_cap_mb": (_ddp, lambda: memory_limit() >> 20, 1e300),
    "num_worker_threads": (_rpc_threads, lambda: 1024, 100_000),
    "--spares": (lambda n: _launch(spares=n), lambda: _fit() - 1, 100_000),
    "--nnodes": (lambda n: _launch(min_nodes=1, max_nodes=n, rdzv_backend="c10d"),
                 lambda: MAX_WORLD_SIZE, 1 << 40),
    "--max-restarts": (lambda n: _launch(max_restarts=n), lambda: 10_000, 10 ** 9),
    "--monitor-interval": (lambda s: _launch(monitor_interval=s), lambda: 86_400.0, 1e300),
    "--shutdown-timeout": (lambda s: _launch(shutdown_timeout=s), lambda: 86_400.0, 1e300),
    "--rdzv-conf join_timeout": (
        lambda s: _launch(rdzv_conf=(("join_timeout", str(s)),)).conf(  # type: ignore[attr-defined]
            "join_timeout", 600.0), lambda: threading.TIMEOUT_MAX, float("inf")),
    "ElasticSampler: dataset size": (_elastic_sampler, lambda: memory_limit() // 64, 1 << 40),
    "ElasticSampler: batch_size": (lambda n: _elastic_sampler(batch_size=n),
                                   lambda: memory_limit() // 640, 1 << 40),
    "ElasticState: min_ranks": (_elastic_state, lambda: MAX_WORLD_SIZE, 1 << 40),
    "TCPStore: world_size": (_tcp_store, lambda: MAX_WORLD_SIZE, 1 << 40),
    "world_size": (_world, lambda: MAX_WORLD_SIZE, 1 << 40),
    "ring_bytes": (_ring_bytes, lambda: shm_chunk_limit(1), 1 << 40),
}


@pytest.mark.parametrize("name", sorted(ARGUMENT_BOUNDS))
def test_an_argument_past_its_limit_is_refused_naming_argument_value_and_limit(
        name: str) -> None:
    make, limit_of, past = ARGUMENT_BOUNDS[name]
    with pytest.raises(ArgumentError) as err:
        make(past)
    assert_names(str(err.value), name, past, limit_of())


def test_a_file_store_world_size_past_the_limit_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ArgumentError) as err:
        _file_store(str(tmp_path), 1 << 40)
    assert_names(str(err.value), "FileStore: world_size", 1 << 40, MAX_WORLD_SIZE)


def test_spares_beyond_what_the_host_holds_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # --spares 100000 forked spares until the launcher could start no thread, and died
    from tandem.run import config as run_config

    monkeypatch.setattr(run_config, "workers_that_fit", lambda: 12)
    assert _launch(nproc_per_node=4, spares=8).spares == 8  # type: ignore[attr-defined]
    with pytest.raises(ArgumentError, match=r"--spares=9 is above its limit of 8 .*"
                                            r"--nproc-per-node 4 .*keep fewer spares"):
        _launch(nproc_per_node=4, spares=9)


def test_a_sampler_with_as_many_replicas_as_the_largest_world_builds_only_its_share() -> None:
    # num_replicas=2**40 ran out of memory padding the index list to 2**40 entries;
    # at the bound, a rank's share of a 10-item dataset is one index
    from tandem.parallel import DistributedSampler

    last = DistributedSampler(_Sized(), num_replicas=MAX_WORLD_SIZE, rank=MAX_WORLD_SIZE - 1,
                              shuffle=False)
    assert list(last) == [(MAX_WORLD_SIZE - 1) % 10]



def test_tandemrun_refuses_a_hundred_thousand_spares_before_starting_anything() -> None:
    from tandem.run.args import parse

    with pytest.raises(ArgumentError, match=r"--spares=100000 is above its limit of \d+"):
        parse(["--nnodes", "1", "--spares", "100000", "train.py"])
