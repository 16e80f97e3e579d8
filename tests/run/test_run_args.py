"""The command line: torchrun's flags in both spellings, PET_<FLAG> defaults, bad values."""

from __future__ import annotations

import importlib
import os
import re
import signal

import pytest

from tandem.errors import ArgumentError
from tandem.run import main
from tandem.run.args import (
    REFUSED_FLAGS,
    _EnvFlag,
    build_parser,
    operator_defaults,
    parse,
    slurm_defaults,
)
from tandem.run.config import RDZV_CONF_KEYS, LaunchConfig, Std, StdMap

pytestmark = pytest.mark.timeout(30)


def test_dash_and_underscore_spellings_mean_the_same() -> None:
    dashes = parse(["--nproc-per-node", "3", "--max-restarts", "2", "--node-rank", "1",
                    "--nnodes", "2", "--master-addr", "h", "--master-port", "1234",
                    "--monitor-interval", "0.2", "--log-dir", "L", "--rdzv-id", "x",
                    "--local-ranks-filter", "0,2", "train.py", "--lr", "3"])
    unders = parse(["--nproc_per_node=3", "--max_restarts=2", "--node_rank=1", "--nnodes=2",
                    "--master_addr=h", "--master_port=1234", "--monitor_interval=0.2",
                    "--log_dir=L", "--rdzv_id=x", "--local_ranks_filter=0,2", "train.py",
                    "--lr", "3"])
    assert dashes == unders
    assert dashes.nproc_per_node == 3 and dashes.node_rank == 1 and dashes.master_port == 1234
    assert dashes.args == ("--lr", "3") and dashes.local_ranks_filter == {0, 2}


def test_pet_environment_supplies_flags_and_command_line_wins(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_NPROC_PER_NODE", "4")
    monkeypatch.setenv("PET_MAX_RESTARTS", "5")
    monkeypatch.setenv("PET_STANDALONE", "1")
    cfg = parse(["train.py"])
    assert (cfg.nproc_per_node, cfg.max_restarts, cfg.standalone) == (4, 5, True)
    assert parse(["--nproc_per_node", "2", "train.py"]).nproc_per_node == 2


def test_script_arguments_are_left_alone() -> None:
    cfg = parse(["--nproc-per-node", "2", "train.py", "--nproc-per-node", "7", "-m", "x"])
    assert cfg.entrypoint == "train.py"
    assert cfg.args == ("--nproc-per-node", "7", "-m", "x") and not cfg.module


def test_nproc_cpu_and_auto_count_cpus_without_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert parse(["--nproc-per-node", "cpu", "t.py"]).nproc_per_node == os.cpu_count()
    assert parse(["--nproc-per-node", "auto", "t.py"]).nproc_per_node == os.cpu_count()
    with pytest.raises(ArgumentError, match="no GPU"):
        parse(["--nproc-per-node", "gpu", "t.py"])


def test_nnodes_takes_n_or_min_max() -> None:
    assert (parse(["--nnodes", "3", "t.py"]).min_nodes, parse(["--nnodes", "3", "t.py"]).max_nodes) == (3, 3)
    cfg = parse(["--nnodes", "1:4", "--rdzv-backend", "c10d", "t.py"])
    assert (cfg.min_nodes, cfg.max_nodes, cfg.rdzv_backend) == (1, 4, "c10d")
    with pytest.raises(ArgumentError, match="MIN:MAX"):
        parse(["--nnodes", "a:b:c", "t.py"])


def test_redirect_and_tee_maps_decide_what_reaches_the_console() -> None:
    cfg = parse(["-r", "0:3,1:1", "-t", "1:2", "--local-ranks-filter", "0,1", "t.py"])
    assert cfg.redirects == StdMap(Std.NONE, ((0, Std.ALL), (1, Std.OUT)))
    assert not cfg.console_for(0, Std.OUT) and not cfg.console_for(0, Std.ERR)
    assert not cfg.console_for(1, Std.OUT) and cfg.console_for(1, Std.ERR)
    assert not cfg.console_for(2, Std.OUT)  # filtered out
    assert cfg.keeps_files
    assert not parse(["t.py"]).keeps_files
    assert parse(["--nproc-per-node", "2", "--local-ranks-filter", "0,1", "t.py"]
                 ).filter_note() is None
    assert parse(["--nproc-per-node", "2", "--local-ranks-filter", "1,5,7", "t.py"]
                 ).filter_note() == ("--local-ranks-filter names local rank(s) 5, 7, but this "
                                     "node runs local ranks 0-1")


def test_signals_rdzv_conf_and_standalone() -> None:
    cfg = parse(["--standalone", "--signals-to-handle", "SIGTERM,USR1",
                 "--rdzv-conf", "join_timeout=5", "t.py"])
    assert cfg.signals == (signal.SIGTERM, signal.SIGUSR1)
    assert cfg.conf("join_timeout", 600) == 5.0 and cfg.master_addr == "127.0.0.1"
    assert signal.SIGUSR2 in parse(["t.py"]).signals


@pytest.mark.parametrize("argv, message", [
    (["--standalone", "--nnodes", "2", "t.py"], "--standalone"),
    (["-m", "--no-python", "t.py"], "cannot be used together"),
    (["--nproc-per-node", "0", "t.py"], "--nproc-per-node must be >= 1, got 0"),
    (["--nproc-per-node", "-2", "t.py"], "--nproc-per-node must be >= 1, got -2"),
    (["--nnodes", "2", "--node-rank", "2", "t.py"], "node-rank"),
    (["-r", "7", "t.py"], "--redirects"),
    (["--rdzv-backend", "etcd", "--nnodes", "2", "t.py"], "static and c10d"),
    (["--spares", "-1", "t.py"], "--spares must be >= 0"),
    (["--monitor-interval", "nan", "t.py"], "--monitor-interval must be > 0"),
    (["--monitor-interval", "inf", "t.py"], "--monitor-interval must be > 0"),
    (["--log-dir", "/proc/no-such-dir", "t.py"], "--log-dir /proc/no-such-dir: cannot write"),
    # a folder whose mode lets root write (os.access: yes) but where no file can be made
    (["--log-dir", "/sys/kernel", "t.py"], "--log-dir /sys/kernel: cannot write"),
])
def test_bad_values_are_refused_with_the_flag_named(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flag", sorted(REFUSED_FLAGS))
def test_torchruns_flags_for_what_tandemrun_lacks_are_refused_saying_why(
        flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    why, nargs = REFUSED_FLAGS[flag]
    for spelling in {f"--{flag}", "--" + flag.replace("-", "_")}:
        with pytest.raises(SystemExit) as info:
            parse([spelling, *(["x"] if nargs is None else []), "t.py"])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert f"{spelling} is a torchrun flag tandemrun does not support: {why}" in err, err


def test_every_torchrun_flag_is_taken_or_refused() -> None:
    torchrun = importlib.import_module("torch.distributed.run").get_args_parser()
    ours = {s for a in build_parser()._actions for s in a.option_strings}
    theirs = {s for a in torchrun._actions for s in a.option_strings} - {"-h", "--help"}
    assert theirs <= ours, f"torchrun flags tandemrun neither takes nor refuses: {theirs - ours}"


def test_more_workers_than_the_host_could_hold_are_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # a typo (100000 for 10) would start processes until memory ran out
    from tandem.run import config

    monkeypatch.setattr(config, "workers_that_fit", lambda: 12)
    assert parse(["--nproc-per-node", "12", "t.py"]).nproc_per_node == 12
    with pytest.raises(ArgumentError, match="--nproc-per-node 13: .* at most about 12 workers"):
        parse(["--nproc-per-node", "13", "t.py"])
    monkeypatch.undo()  # the real count, from /proc/meminfo
    fit = config.workers_that_fit()
    assert fit is None or 1 <= fit < 10 ** 6
    with pytest.raises(ArgumentError, match="start fewer workers per node"):
        parse(["--nproc-per-node", str(10 ** 9), "t.py"])


def test_a_signal_while_workers_start_stops_the_starting() -> None:
    from tandem.run.workers import WorkerGroup

    started: list[str] = []
    group = WorkerGroup(["a", "b", "c", "d"], None, None)  # type: ignore[list-item, arg-type]
    group.add = lambda spec, launch=None: started.append(spec)  # type: ignore[method-assign, assignment, misc]
    group.start(lambda: len(started) >= 2)  # the ending signal came while starting "b"
    assert started == ["a", "b"]


def test_config_is_usable_without_argparse() -> None:
    cfg = LaunchConfig(entrypoint="t.py", nproc_per_node=2)
    assert cfg.nnodes == 1 and not cfg.multi_node and cfg.console_for(1, Std.ERR)


def test_min_max_nodes_need_the_c10d_backend() -> None:
    with pytest.raises(ArgumentError, match="c10d"):
        parse(["--nnodes", "1:2", "t.py"])


@pytest.mark.parametrize("given, meant", [
    ("--nproc", "--nproc-per-node"),        # torchrun users' shorthand: no abbreviation is taken
    ("--nproc=2", "--nproc-per-node"),
    ("--max-restart", "--max-restarts"),    # a letter short
    ("--standalon", "--standalone"),
    ("--nodes", "--nnodes"),                # no prefix of any flag: the closest spelling
])
def test_an_unknown_flag_is_refused_naming_the_flag_it_resembles(
        given: str, meant: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse([given, "2", "train.py"] if "=" not in given else [given, "train.py"])
    assert info.value.code == 2
    assert f"unrecognized arguments: {given}" in (err := capsys.readouterr().err), err
    assert f"(did you mean {meant}?)" in err, err


# what srun -N2 --ntasks-per-node=1 gives each task (SLURM 22.05, job 4242)
SLURM_STEP = {"SLURM_JOB_ID": "4242", "SLURM_NODEID": "1", "SLURM_PROCID": "1",
              "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2",
              "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_NODELIST": "gpu[07-08]"}


def test_one_tandemrun_per_node_under_srun_needs_no_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    assert slurm_defaults(SLURM_STEP, resolve=lambda n: f"addr-of-{n}") == {
        "nnodes": "2", "node_rank": 1, "master_addr": "addr-of-gpu07", "master_port": 14242,
        "rdzv_endpoint": "addr-of-gpu07:14242", "rdzv_id": "slurm-4242"}
    assert slurm_defaults({k: v for k, v in SLURM_STEP.items() if "STEP" not in k}) == {}
    for key, value in {**SLURM_STEP, "SLURM_STEP_NODELIST": "localhost"}.items():
        monkeypatch.setenv(key, value)
    cfg = parse(["--nproc-per-node", "2", "train.py"])
    assert (cfg.nnodes, cfg.node_rank, cfg.master_addr, cfg.master_port) == (2, 1, "localhost", 14242)
    monkeypatch.setenv("PET_NODE_RANK", "0")  # PET_* and flags still win
    cfg = parse(["--master-port", "29400", "train.py"])
    assert (cfg.node_rank, cfg.master_port) == (0, 29400)


def test_several_tandemruns_on_one_node_are_refused_with_the_fix() -> None:
    with pytest.raises(ArgumentError, match="runs 4 tasks on 2 node.*--ntasks-per-node=1"):
        slurm_defaults({**SLURM_STEP, "SLURM_STEP_NUM_TASKS": "4"})


def test_a_pytorchjob_pod_before_1_8_gives_node_0_as_master_addr_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pod = {"MASTER_ADDR": "train-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "4",
           "RANK": "1", "PET_NNODES": "2", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "1"}
    assert operator_defaults(pod) == {"master_addr": "train-master-0", "master_port": 23456}
    assert operator_defaults({**pod, "PET_MASTER_ADDR": "a", "PET_MASTER_PORT": "1"}) == {}
    assert operator_defaults({"MASTER_ADDR": "x", "MASTER_PORT": "1"}) == {}  # no job: ignored
    for key, value in pod.items():
        monkeypatch.setenv(key, value)
    cfg = parse(["train.py"])
    assert (cfg.nnodes, cfg.node_rank, cfg.nproc_per_node) == (2, 1, 2)
    assert (cfg.master_addr, cfg.master_port) == ("train-master-0", 23456)


# every numeric flag (the name its error must carry, the command line), with a second
# node where the flag needs one
NUMERIC_FLAGS = [
    ("--nproc-per-node", ["--nproc-per-node", "{}"]), ("--nnodes", ["--nnodes", "{}"]),
    ("--nnodes", ["--nnodes", "1:{}"]), ("--node-rank", ["--nnodes", "2", "--node-rank", "{}"]),
    ("--master-port", ["--master-port", "{}"]), ("--max-restarts", ["--max-restarts", "{}"]),
    ("--spares", ["--spares", "{}"]), ("--monitor-interval", ["--monitor-interval", "{}"]),
    ("--shutdown-timeout", ["--shutdown-timeout={}"]),
    ("--rdzv-endpoint", ["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:{}"]),
    *((f"--rdzv-conf {key}", ["--rdzv-conf", f"{key}={{}}"]) for key in RDZV_CONF_KEYS),
]


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "abc", "1e999"])
@pytest.mark.parametrize("name, flag", NUMERIC_FLAGS, ids=lambda f: " ".join(f) if isinstance(f, list) else f)
def test_every_numeric_flag_given_nan_inf_negative_or_a_word_is_refused_naming_it(
        name: str, flag: list[str], value: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [part.format(value) for part in flag] + ["t.py"]
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own refusal of a value that is not an int
        code = exc.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    assert code == 2, (argv, err)
    assert name in err, (argv, err)


@pytest.mark.parametrize("endpoint, backend, nodes, where", [
    ("node0:29401", "c10d", "2", ("node0", 29401)),
    ("node0", "c10d", "2", ("node0", 29400)),
    ("[::1]:29402", "c10d", "2", ("::1", 29402)),
    ("fe80::1", "c10d", "2", ("fe80::1", 29400)),
    ("localhost:0", "c10d", "1", ("localhost", 0)),
    ("node0:1234", "static", "2", ("node0", 1234)),  # torchrun's static backend takes it too
])
def test_the_rendezvous_endpoint_is_read_in_every_form_torchrun_takes(
        endpoint: str, backend: str, nodes: str, where: tuple[str, int]) -> None:
    cfg = parse(["--rdzv-backend", backend, "--rdzv-endpoint", endpoint, "--nnodes", nodes,
                 "t.py"])
    assert cfg.endpoint == where


@pytest.mark.parametrize("endpoint, message", [
    ("h:99999", "the port must be 0..65535"), ("h:-5", "the port must be 0..65535"),
    (":29400", "expected HOST"), ("[::1", "expected HOST"), ("h:p:q]", "expected HOST"),
    ("h:", "the port must be"),
])
def test_a_bad_rendezvous_endpoint_is_refused_even_on_one_node(
        endpoint: str, message: str) -> None:
    # one node never connects to it: the error must still come now, not with a second node
    with pytest.raises(ArgumentError, match=f"--rdzv-endpoint .*{message}"):
        parse(["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "t.py"])


def test_port_zero_is_refused_for_an_endpoint_several_nodes_must_find() -> None:
    with pytest.raises(ArgumentError, match="port 0 picks a free port"):
        parse(["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:0", "--nnodes", "2", "t.py"])


def test_rdzv_conf_keys_tandemrun_does_not_read_are_refused_naming_those_it_reads() -> None:
    for key in ("read_timeout", "is_host", "joint_timeout"):
        with pytest.raises(ArgumentError, match=f"does not read '{key}'; it reads join_timeout"):
            parse(["--rdzv-conf", f"{key}=5", "t.py"])
    with pytest.raises(ArgumentError, match="keep_alive_max_attempt=2.5: must be an int"):
        parse(["--rdzv-conf", "keep_alive_max_attempt=2.5", "t.py"])
    with pytest.raises(ArgumentError, match="join_timeout=0: must be seconds > 0"):
        parse(["--rdzv-conf", "join_timeout=0", "t.py"])
    # a heartbeat every 1e-9 s spins a core like a tiny --monitor-interval
    with pytest.raises(ArgumentError, match="keep_alive_interval=1e-9: must be seconds >= 0.001"):
        parse(["--rdzv-conf", "keep_alive_interval=1e-9", "t.py"])


@pytest.mark.parametrize("name", ["SIGKILL", "SIGSTOP", "CHLD"])
def test_signals_the_launcher_cannot_forward_are_refused(name: str) -> None:
    # SIGKILL and SIGSTOP failed in signal.signal with an OSError traceback
    with pytest.raises(ArgumentError, match="cannot be forwarded to the workers"):
        parse(["--signals-to-handle", f"SIGTERM,{name}", "t.py"])


def test_a_start_method_outside_torchruns_choices_is_refused() -> None:
    for method in ("spawn", "fork", "forkserver"):
        assert parse(["--start-method", method, "t.py"]).entrypoint == "t.py"
    with pytest.raises(ArgumentError, match="--start-method 'thread': expected one of spawn"):
        parse(["--start-method", "thread", "t.py"])


def test_a_negative_local_rank_filter_is_refused() -> None:
    with pytest.raises(ArgumentError, match="--local-ranks-filter '0,-1': local ranks are >= 0"):
        parse(["--local-ranks-filter", "0,-1", "t.py"])


FLAG_DESTS = sorted(a.dest for a in build_parser()._actions if isinstance(a, _EnvFlag))


@pytest.mark.parametrize("dest", FLAG_DESTS)
def test_every_pet_switch_given_a_word_that_is_not_on_or_off_is_refused(
        dest: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # PET_STANDALONE=maybe was read as off, without a word
    monkeypatch.setenv(f"PET_{dest.upper()}", "maybe")
    with pytest.raises(ArgumentError, match=f"PET_{dest.upper()}='maybe': expected one of 0, 1"):
        parse(["t.py"])
    monkeypatch.setenv(f"PET_{dest.upper()}", "Off")
    assert getattr(build_parser().parse_args(["t.py"]), dest) is False


@pytest.mark.parametrize("port", ["abc", "70000", "-1", "1.5", " "])
def test_an_operator_pods_master_port_that_is_not_a_port_is_refused(port: str) -> None:
    # abc was dropped, and the job waited on port 29500 instead; 70000 was blamed on
    # --master-port, which the user never gave
    with pytest.raises(ArgumentError, match=re.escape(f"MASTER_PORT={port!r}") + ".*expected"):
        operator_defaults({"PET_NNODES": "2", "MASTER_PORT": port})


def test_an_operator_pods_master_port_that_is_a_port_is_taken() -> None:
    assert operator_defaults({"PET_NNODES": "2", "MASTER_PORT": "1234"}) == {"master_port": 1234}


@pytest.mark.parametrize("run_id", ["../../elsewhere", "/tmp/x", "..", ".", "a/b", "x" * 201])
def test_a_run_id_that_would_leave_the_log_dir_is_refused(run_id: str) -> None:
    # --log-dir L --rdzv-id ../../elsewhere wrote the workers' logs outside L
    with pytest.raises(ArgumentError, match="--rdzv-id"):
        parse(["--log-dir", "L", "--rdzv-id", run_id, "t.py"])
    assert parse(["--rdzv-id", "job-7.a_b", "t.py"]).rdzv_id == "job-7.a_b"


@pytest.mark.parametrize("interval", ["1e-9", "0.0009", "5e-324"])
def test_a_monitor_interval_below_a_millisecond_is_refused(interval: str) -> None:
    # 1e-9 kept a core busy: 3.1 s of the launcher's CPU in a 6 s job, 0.18 s at 0.1
    with pytest.raises(ArgumentError, match=f"--monitor-interval {float(interval)} is below 0.001"):
        parse(["--monitor-interval", interval, "t.py"])
    assert parse(["--monitor-interval", "0.001", "t.py"]).monitor_interval == 0.001


@pytest.mark.parametrize("name,value", [
    ("SLURM_STEP_NUM_NODES", "abc"), ("SLURM_STEP_NUM_NODES", "0"),
    ("SLURM_STEP_NUM_TASKS", "2.0"), ("SLURM_JOB_ID", "x42"), ("SLURM_JOB_ID", "-1"),
    ("SLURM_NODEID", "abc"), ("SLURM_NODEID", "-1"), ("SLURM_NODEID", "2"),
    ("SLURM_NODEID", ""), ("SLURM_JOB_ID", None), ("SLURM_STEP_NODELIST", None)])
def test_a_wrong_slurm_value_under_srun_is_named_not_read_as_no_step(
        monkeypatch: pytest.MonkeyPatch, name: str, value: str | None) -> None:
    # SLURM_NODEID=abc made tandemrun a single-node launcher without a word
    env = {k: v for k, v in SLURM_STEP.items() if k != name}
    if value is not None:
        env[name] = value
    if name == "SLURM_STEP_NODELIST":
        env.pop("SLURM_JOB_NODELIST")
    with pytest.raises(ArgumentError, match=name):
        slurm_defaults(env, resolve=lambda n: n)
    for key, val in env.items():
        monkeypatch.setenv(key, val)
    with pytest.raises(ArgumentError, match=name):
        parse(["train.py"])


@pytest.mark.parametrize("name,value", [
    ("PET_MASTER_PORT", "70000"), ("PET_MASTER_PORT", "abc"), ("PET_NODE_RANK", "-1"),
    ("PET_NODE_RANK", "x"), ("PET_NNODES", "abc"), ("PET_NNODES", "0"),
    ("PET_NPROC_PER_NODE", "0"), ("PET_NPROC_PER_NODE", "two"), ("PET_MAX_RESTARTS", "-1"),
    ("PET_MAX_RESTARTS", "1.5"), ("PET_SPARES", "-2"), ("PET_MONITOR_INTERVAL", "nan"),
    ("PET_MONITOR_INTERVAL", "fast"), ("PET_SHUTDOWN_TIMEOUT", "-1"),
    ("PET_SHUTDOWN_TIMEOUT", "inf"), ("PET_REDIRECTS", "7"), ("PET_TEE", "x"),
    ("PET_LOCAL_RANKS_FILTER", "-1"), ("PET_RDZV_ENDPOINT", "h:70000")])
def test_a_wrong_pet_value_names_the_variable_not_only_its_flag(
        monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    # PET_MASTER_PORT=70000 said "--master-port must be 0..65535", a flag never given
    monkeypatch.setenv(name, value)
    if name == "PET_RDZV_ENDPOINT":
        monkeypatch.setenv("PET_RDZV_BACKEND", "c10d")
    with pytest.raises(ArgumentError, match=re.escape(f"{name}={value!r}")):
        parse(["train.py"])


def test_a_flag_given_wins_over_a_wrong_pet_value_and_is_named_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_MASTER_PORT", "abc")
    assert parse(["--master-port", "1234", "train.py"]).master_port == 1234
    with pytest.raises(ArgumentError) as err:
        parse(["--master-port", "70000", "train.py"])
    assert "--master-port must be 0..65535" in str(err.value)
    assert "PET_MASTER_PORT" not in str(err.value)
