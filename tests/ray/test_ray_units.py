"""tandem.ray without a Ray cluster: scaling checks, rank numbering, refusals, and the
actor's output capture (in a process of its own, as in a Ray worker).

The real cluster runs in ``tests/cluster/test_ray.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from tandem.errors import ArgumentError, StateError
from tandem.ray import ScalingConfig, Trainer
from tandem.ray import _actor
from tandem.ray._scaling import Placed, assign_ranks


def _node(cpus: float, alive: bool = True) -> dict[str, Any]:
    return {"Alive": alive, "Resources": {"CPU": cpus}}


@pytest.mark.parametrize("workers", [0, -1, 1.5, True])
def test_a_job_without_a_whole_positive_number_of_workers_is_refused(workers: Any) -> None:
    with pytest.raises(ArgumentError, match=r"num_workers=.*at least 1 worker"):
        ScalingConfig(num_workers=workers)


@pytest.mark.parametrize("cpus", [0, -1, float("nan"), float("inf")])
def test_cpus_per_worker_must_be_a_positive_number(cpus: float) -> None:
    with pytest.raises(ArgumentError, match=r"cpus_per_worker=.*> 0"):
        ScalingConfig(num_workers=2, cpus_per_worker=cpus)


def test_an_unknown_placement_strategy_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ArgumentError, match=r"'spread'.*PACK, SPREAD, STRICT_SPREAD"):
        ScalingConfig(num_workers=2, placement_strategy="spread")


def test_more_strict_spread_workers_than_alive_nodes_are_refused_before_waiting() -> None:
    cfg = ScalingConfig(num_workers=3, placement_strategy="STRICT_SPREAD", cpus_per_worker=0.5)
    nodes = [_node(2), _node(2), _node(2, alive=False)]
    with pytest.raises(ArgumentError, match=r"num_workers=3.*STRICT_SPREAD.*has 2 alive"):
        cfg.check_fits(nodes)
    cfg.check_fits([_node(2)] * 3)  # one a node: fits


def test_more_cpus_than_the_cluster_has_are_refused_counting_whole_bundles() -> None:
    # 3 bundles of 1.5 CPUs: 2 nodes of 2 CPUs hold one each, though 4 >= 4.5 is false
    # anyway; 2 bundles of 1.5 fit in 2 nodes but not in one node of 3.5
    with pytest.raises(ArgumentError, match=r"CPU 1.5 per worker.*\[2.0, 2.0\]"):
        ScalingConfig(num_workers=3, cpus_per_worker=1.5).check_fits([_node(2), _node(2)])
    with pytest.raises(ArgumentError, match=r"too little for 2 workers"):
        ScalingConfig(num_workers=2, cpus_per_worker=1.5).check_fits([_node(2.9)])
    ScalingConfig(num_workers=2, cpus_per_worker=1.5).check_fits([_node(2), _node(2)])


def test_ranks_are_contiguous_per_node_in_the_order_nodes_first_appear() -> None:
    placed = [Placed(n, f"10.0.0.{n}", f"h{n}", i) for i, n in
              enumerate(["b", "a", "b", "a", "c"])]
    # (rank, local rank, local world size, node rank) per actor, in bundle order
    assert assign_ranks(placed) == [(0, 0, 2, 0), (2, 0, 2, 1), (1, 1, 2, 0), (3, 1, 2, 1),
                                    (4, 0, 1, 2)]


def test_a_trainer_refuses_what_is_not_a_function_or_a_scaling_config() -> None:
    with pytest.raises(ArgumentError, match="train_loop_per_worker"):
        Trainer(42, scaling_config=ScalingConfig(num_workers=1))  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="scaling_config"):
        Trainer(print, scaling_config={"num_workers": 2})  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="max_restarts"):
        Trainer(print, scaling_config=ScalingConfig(num_workers=1), max_restarts=-1)


def test_without_ray_installed_fit_says_how_to_install_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now raises ImportError
    trainer = Trainer(print, scaling_config=ScalingConfig(num_workers=2))
    with pytest.raises(StateError, match=r"needs Ray.*pip install 'tandem\[ray\]'"):
        trainer.fit()


_CAPTURE = textwrap.dedent("""
    import json, os, sys
    from tandem.ray._actor import capture_output

    def fn():
        print("from python", 21)
        os.write(1, b"from C, no newline at first")
        os.write(1, b"; now it ends\\n")
        print("to stderr", file=sys.stderr)
        os.write(2, b"x" * 70000 + b"\\n")  # past the cap: cut in two
        return 42

    pushed, settled = [], []
    value = capture_output(fn, lambda lines: pushed.append(list(lines)) or len(pushed),
                           settled.append)
    print(json.dumps({"value": value, "lines": [l for batch in pushed for l in batch],
                      "settled": settled, "pushes": len(pushed)}))
""")


@pytest.mark.smoke("tandem.ray")
def test_an_actors_output_is_captured_line_by_line_from_both_descriptors() -> None:
    done = subprocess.run([sys.executable, "-c", _CAPTURE], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])  # fd 1 is its own again
    assert out["value"] == 42
    by_stream = {s: [text for stream, text in out["lines"] if stream == s]
                 for s in ("stdout", "stderr")}  # the two pipes are read apart
    assert by_stream == {"stdout": ["from python 21", "from C, no newline at first; now it ends"],
                         "stderr": ["to stderr", "x" * 65536, "x" * (70000 - 65536)]}
    assert out["settled"] == [out["pushes"]]  # the last push was waited for


def test_the_sink_hands_out_lines_once_and_drops_the_oldest_past_its_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_actor, "MAX_KEPT_LINES", 3)
    sink = _actor.OutputSink()
    sink.put("0.0", [("stdout", "a"), ("stderr", "b")])
    assert sink.take() == ([("0.0", "stdout", "a"), ("0.0", "stderr", "b")], 0)
    assert sink.take() == ([], 0)
    sink.put("1.0", [("stdout", str(i)) for i in range(5)])
    assert sink.take() == ([("1.0", "stdout", str(i)) for i in (2, 3, 4)], 2)


def test_a_dead_actor_is_described_from_rays_exit_type_and_detail_in_one_line() -> None:
    ray_says = ("The actor died unexpectedly before finishing this task.\n\tclass_name: "
                "RankActor\n\tpid: 30519\nWorker exit type: SYSTEM_ERROR Worker exit detail: "
                "Worker unexpectedly exits with a connection error code 2. End of file. Some "
                "common causes include: (1) the process was killed by the OOM killer ...")
    assert Trainer._death(RuntimeError(ray_says)) == (
        "died: its actor's process ended (end of file: killed, by a signal or the OOM "
        "killer, or crashed); Ray says SYSTEM_ERROR, Worker unexpectedly exits with a "
        "connection error code 2")
    assert Trainer._death(RuntimeError("node lost")) == "died: node lost"


def test_the_first_rank_named_is_a_death_not_the_peers_that_lost_it() -> None:
    from tandem.ray._trainer import _Slot

    trainer = Trainer(print, scaling_config=ScalingConfig(num_workers=3))
    slots = [_Slot(i, i, placed=Placed(f"n{i}", f"10.0.0.{i}", f"h{i}", 100 + i))
             for i in range(3)]
    for s in slots:
        s.done = True
    slots[0].traceback = "Traceback ... PeerLostError"
    # rank 0 noticed first that rank 2 was gone; rank 2's death came in after it
    failed = [(1.0, slots[0], "raised PeerLostError: rank 2 closed its connection", False),
              (2.0, slots[2], "died: its actor's process ended", True)]
    err = trainer._failure(slots, failed)
    assert (err.rank, err.node, err.cause) == (2, "10.0.0.2", "died: its actor's process ended")
    lines = str(err).splitlines()
    assert lines[0] == ("tandem.ray: rank 2 (node 10.0.0.2, host h2, pid 102) died: its "
                        "actor's process ended")
    assert lines[1].startswith("  then rank 0 (node 10.0.0.0, host h0, pid 100) raised Peer")
    # a rank that raised something of its own is the root cause, with its traceback
    failed = [(1.0, slots[0], "raised PeerLostError: rank 1 closed its connection", False),
              (2.0, slots[1], "raised ValueError: bad batch", False)]
    slots[1].traceback = "Traceback (most recent call last): ... ValueError: bad batch"
    err = trainer._failure(slots, failed)
    assert err.rank == 1 and str(err).splitlines()[1].startswith("Traceback")
