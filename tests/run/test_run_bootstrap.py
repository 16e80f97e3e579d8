"""The worker bootstrap on its own: parent checks and the error record."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.run.workers import BOOTSTRAP

pytestmark = [pytest.mark.procs, pytest.mark.timeout(240)]


def bootstrap(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    # a deadline, not a bound: a worker importing torch took over 30 s with files run side by side
    return subprocess.run([sys.executable, BOOTSTRAP, *args], capture_output=True, text=True,
                          timeout=110, env=env)


def test_a_worker_whose_launcher_is_already_gone_exits_at_once(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    script = tmp_path / "s.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    res = bootstrap("--parent", "1", str(script))  # pid 1 is not our parent
    assert res.returncode == 1 and not marker.exists()


def test_the_error_record_has_rank_host_type_message_and_traceback(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("import sys\nassert sys.argv[1:] == ['a'], sys.argv\n"
                      "raise KeyError('missing')\n")
    error_file = tmp_path / "error.json"
    env = {**os.environ, "RANK": "5", "LOCAL_RANK": "1", "TANDEM_ERROR_FILE": str(error_file)}
    res = bootstrap("--parent", str(os.getpid()), str(script), "a", env=env)
    assert res.returncode == 1
    assert res.stderr.startswith("Traceback") and "KeyError: 'missing'" in res.stderr
    record = json.loads(error_file.read_text())
    assert (record["rank"], record["local_rank"], record["exc_type"]) == (5, 1, "KeyError")
    assert record["message"] == "'missing'" and record["host"]
    assert 's.py", line 3, in <module>' in record["traceback"]
    assert "runpy" not in record["traceback"]


def test_sys_exit_is_passed_through_without_a_record(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("import sys\nsys.exit(7)\n")
    error_file = tmp_path / "error.json"
    env = {**os.environ, "TANDEM_ERROR_FILE": str(error_file)}
    res = bootstrap("--parent", str(os.getpid()), str(script), env=env)
    assert res.returncode == 7 and not error_file.exists()


def failing(tmp_path: Path, body: str, **env: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    """Run ``body`` as a worker script; its result and its error record."""
    script = tmp_path / "s.py"
    script.write_text(body)
    error_file = tmp_path / "error.json"
    if error_file.exists():
        error_file.unlink()
    res = bootstrap("--parent", str(os.getpid()), str(script),
                    env={**os.environ, "TANDEM_ERROR_FILE": str(error_file), **env})
    # (once in a full run the record was missing: say what the worker did instead)
    assert error_file.exists(), (f"no error record; exit {res.returncode}, "
                                 f"stdout {res.stdout!r}, stderr {res.stderr!r}")
    return res, json.loads(error_file.read_text())


BAD_TIMEOUT = "from tandem.config import timeout_seconds\ntimeout_seconds(-1.0, 1.0)\n"


def test_tandems_own_frames_are_folded_into_one_line(tmp_path: Path) -> None:
    res, record = failing(tmp_path, BAD_TIMEOUT, TANDEM_DEBUG="0")
    assert res.returncode == 1
    assert res.stderr.splitlines() == [
        "Traceback (most recent call last):",
        f'  File "{tmp_path / "s.py"}", line 2, in <module>',
        "    timeout_seconds(-1.0, 1.0)",
        "  ... 1 frame inside tandem (TANDEM_DEBUG=1 shows them)",
        "tandem.errors.ArgumentError: " + record["message"]]
    assert record["shown"] and record["traceback"] == res.stderr
    assert "tandem/config.py" in record["traceback_full"]


def test_tandem_debug_shows_every_frame(tmp_path: Path) -> None:
    res, _ = failing(tmp_path, BAD_TIMEOUT, TANDEM_DEBUG="1")
    assert "tandem/config.py" in res.stderr and "inside tandem" not in res.stderr


def test_only_the_first_failing_rank_prints_its_traceback(tmp_path: Path) -> None:
    claim = str(tmp_path / "traceback_shown")
    first, _ = failing(tmp_path, "x = 1\nraise ValueError('boom')\n", TANDEM_TRACEBACK_ONCE=claim)
    assert first.stderr.startswith("Traceback") and first.returncode == 1
    later, record = failing(tmp_path, "x = 1\nraise ValueError('boom')\n",
                            TANDEM_TRACEBACK_ONCE=claim)
    assert later.stderr == f"ValueError at {tmp_path / 's.py'}:2 in <module>: boom\n"
    assert not record["shown"] and "Traceback" in record["traceback"]


def test_a_lost_peer_is_one_line_even_if_first_it_is_not_the_cause(tmp_path: Path) -> None:
    body = "from tandem.errors import PeerLostError\nraise PeerLostError('rank 0 died', 0)\n"
    res, record = failing(tmp_path, body, TANDEM_TRACEBACK_ONCE=str(tmp_path / "claim"))
    assert res.stderr == f"tandem.errors.PeerLostError at {tmp_path / 's.py'}:2 in <module>: " \
                         "rank 0 died\n"
    assert not (tmp_path / "claim").exists()  # a real cause may still print its traceback


def test_ctrl_c_prints_one_line_and_the_worker_dies_of_sigint(tmp_path: Path) -> None:
    body = ("import os, signal, threading, time\n"
            "threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()\n"
            "time.sleep(5)\n")
    res, record = failing(tmp_path, body)
    assert res.stderr == f"KeyboardInterrupt at {tmp_path / 's.py'}:3 in <module>\n"
    assert res.returncode == -signal.SIGINT
    assert record["exc_type"] == "KeyboardInterrupt"


TORCH_SAMPLER = ("import torch\nfrom torch.utils.data import DistributedSampler\n{init}"
                 "DistributedSampler(list(range(4)))\n")


def test_a_torch_call_that_cannot_see_tandems_group_says_which_import_to_change(
        tmp_path: Path) -> None:
    # a half-ported script: tandem's group, torch's sampler (from torch.utils.data)
    init = "import tandem\ntandem.init_process_group(store=tandem.HashStore(), rank=0, world_size=1)\n"
    res, record = failing(tmp_path, TORCH_SAMPLER.format(init=init), TANDEM_DEBUG="0")
    assert "Default process group has not been initialized" in res.stderr, res.stderr
    assert "tandem's process group is initialised" in res.stderr, res.stderr
    assert "torch/utils/data/distributed.py" in res.stderr, res.stderr
    assert "tandem.parallel.DistributedSampler" in res.stderr, res.stderr
    assert "tandem.parallel.DistributedSampler" in record["traceback"]
    # a script that never initialised anything gets torch's message alone
    res, _ = failing(tmp_path, TORCH_SAMPLER.format(init=""), TANDEM_DEBUG="0")
    assert "Default process group has not been initialized" in res.stderr, res.stderr
    assert "initialised" not in res.stderr and "DistributedSampler" in res.stderr, res.stderr


def test_a_refused_name_in_a_from_import_keeps_its_message(tmp_path: Path) -> None:
    # `from m import x` turns m's AttributeError into a bare ImportError: the bootstrap
    # adds the refusal's message (what to use instead) as a note
    res, record = failing(tmp_path, "from tandem import init_device_mesh\n", TANDEM_DEBUG="0")
    assert "cannot import name 'init_device_mesh'" in res.stderr, res.stderr
    assert "tandem.torch_backend" in res.stderr, res.stderr  # the refusal's advice
    assert "tandem.torch_backend" in record["traceback"]
    res, _ = failing(tmp_path, "from tandem.algorithms.ddp_comm_hooks.quantization_hooks "
                     "import quantization_pertensor_hook\n", TANDEM_DEBUG="0")
    assert ("No module named 'tandem.algorithms.ddp_comm_hooks.quantization_hooks'"
            in res.stderr), res.stderr
    assert "powerSGD_hook" in res.stderr, res.stderr
    res, _ = failing(tmp_path, "from tandem import no_such_name\n", TANDEM_DEBUG="0")
    assert res.stderr.rstrip().endswith("(" + str(Path(__file__).parents[2] / "tandem" /
                                        "__init__.py") + ")"), res.stderr  # no note
