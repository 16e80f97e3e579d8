"""The staging arena's size is checked against the host before any memory is reserved.

``TANDEM_SHM_CHUNK=2**32`` once passed init and then reserved memory with
``posix_fallocate`` until the OOM killer stopped processes of other jobs. The settings
refuse it on their own (``tests/test_config_bounds.py``); this is the end-to-end check
that the arena, which knows how many ranks share the host, holds the bound too.
"""

from __future__ import annotations

import pytest

from _shm_bound_ranks import arena_on_a_smaller_machine, arena_past_the_address_space_limit
from tandem.testing import launch

pytestmark = [pytest.mark.timeout(120), pytest.mark.procs]


def test_a_staging_chunk_too_large_for_the_host_is_refused_before_it_is_reserved() -> None:
    # 16 MiB of memory: 2 ranks may stage at most 256 KiB each (a 64th); 1 MiB asked for
    memory = 16 << 20
    outcomes = launch(2, arena_on_a_smaller_machine, (memory,), backend="shm", timeout=90,
                      env={"TANDEM_SHM_CHUNK": str(1 << 20), "TANDEM_ALGORITHM": "shm"})
    bad = [o for o in outcomes if not o.ok]
    assert not bad, "\n".join(f"--- rank {o.rank} ---\n{o.error}" for o in bad)
    for o in outcomes:
        refused = o.value["refused"]
        assert refused, f"rank {o.rank}: the arena was made: {o.value}"
        for part in ("TANDEM_SHM_CHUNK=1048576", "limit of 262144", "unset it"):
            assert part in refused, f"rank {o.rank}: {part!r} not in {refused!r}"


def test_an_arena_this_process_may_not_map_is_refused_naming_the_setting() -> None:
    # 2 ranks x 2 halves x 64 MiB = 256 MiB to map, with 96 MiB of address space left
    outcomes = launch(2, arena_past_the_address_space_limit, (96 << 20,), backend="shm",
                      timeout=90, op_timeout=30.0, env={"TANDEM_SHM_CHUNK": str(64 << 20)})
    bad = [o for o in outcomes if not o.ok]
    assert not bad, "\n".join(f"--- rank {o.rank} ---\n{o.error}" for o in bad)
    for o in outcomes:
        refused = o.value["refused"]
        for part in ("cannot map the shared staging memory of 2 ranks",
                     "TANDEM_SHM_CHUNK=67108864", "ulimit -v"):
            assert part in refused, f"rank {o.rank}: {part!r} not in {refused!r}"
