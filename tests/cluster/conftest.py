"""One real SLURM cluster (munged, slurmctld, 2 slurmd) shared by the tests of one module."""

from __future__ import annotations

from typing import Iterator

import pytest

from tandem.testing.netns import Unavailable
from tandem.testing.slurm import SlurmCluster, slurm_cluster


@pytest.fixture(scope="module")  # torn down with its module, whose tests are marked procs
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    try:
        with slurm_cluster(2, tmp_path_factory.mktemp("slurm")) as cluster:
            yield cluster
    except Unavailable as why:
        pytest.skip(str(why))
