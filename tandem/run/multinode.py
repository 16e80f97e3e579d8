"""Multi-node rendezvous through a TCPStore hosted by one of the agents.

Static (torchrun's default)::

    # on node 0 (10.0.0.1) and node 1, with the same secret on both:
    export TANDEM_SECRET=$(cat /shared/job.secret)
    tandemrun --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 train.py
    tandemrun --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500 train.py

Node 0's agent serves the agents' store on ``master-addr:master-port``; the workers'
``MASTER_PORT`` is another port that node 0 reserves per round (rank 0's store must
bind it). For c10d (``--rdzv-backend c10d --rdzv-endpoint HOST:PORT``, also with
``--nnodes MIN:MAX``) see :mod:`tandem.run.dynamic`.

Per round ``n`` the keys under ``tandemrun/<n>/`` are: ``node/<k>`` (host, nproc,
role, restarts of node k), ``joined``/``complete`` (the static barrier), ``master``
(the workers' address and port), ``failed`` and ``failures/<k>`` (who failed, with
their error records), ``succeeded`` (the exit barrier). Every node restarts when any
node fails -- or stops its heartbeat (:mod:`tandem.run.heartbeat`) -- so rounds stay
in lock-step.
"""

from __future__ import annotations

import json
import socket
import time
import uuid
from typing import Any, Callable

from tandem import _wire
from tandem._words import counted, secs
from tandem.errors import ArgumentError, NetworkError, StoreTimeoutError, TandemError
from tandem.run.config import LaunchConfig
from tandem.run.heartbeat import Heartbeat, Watch
from tandem.run.rendezvous import Assignment, Rendezvous, reserve_port, wait_until
from tandem.run.rootcause import Failure
from tandem.store.base import Store
from tandem.store.tcp import TCPStore

__all__ = ["StoreRendezvous", "local_address", "connect_waiting", "gives_up"]

JOIN_TIMEOUT = 600.0  # seconds every node has to join a round (--rdzv-conf join_timeout)
LEAVE_TIMEOUT = 10.0  # how long the store's host waits for the agents that joined to leave


def local_address(toward: str) -> str:
    """The address of the interface that routes to ``toward`` (loopback stays loopback)."""
    try:
        return _wire.route_address(toward)
    except OSError:
        return socket.getfqdn()


def _endpoint(cfg: LaunchConfig) -> tuple[str, int]:
    return cfg.endpoint


def gives_up(timeout: float) -> str:
    return f"gives up after {secs(timeout)}s (--rdzv-conf join_timeout=SECONDS)"


def connect_waiting(cfg: LaunchConfig) -> tuple[Callable[[float], str], float]:
    """What a node that cannot reach the rendezvous store yet says it waits for (a
    :class:`~tandem.run.rendezvous.StillWaiting` description), and the timeout."""
    host, port = _endpoint(cfg)
    timeout = cfg.conf("join_timeout", JOIN_TIMEOUT)

    def describe(seconds: float) -> str:
        try:  # a name that does not resolve may still come up (a late host), so say it
            socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            why = ("node 0 serves it: is it started, with this --master-addr and "
                   "--master-port?" if cfg.rdzv_backend == "static" else
                   "the first node that can bind it serves it: is one started, with this "
                   "--rdzv-endpoint?")
        except socket.gaierror as exc:
            why = f"the host name {host!r} does not resolve ({exc})"
        return (f"still waiting for the rendezvous store at {host}:{port} after "
                f"{seconds:.0f}s ({why}); {gives_up(timeout)}")

    return describe, timeout


def _lost_agent(node_rank: int, node: dict[str, Any], first_rank: int) -> Failure:
    """The failure reported for a node whose agent stopped its heartbeat."""
    return Failure(rank=first_rank, local_rank=-1, node_rank=node_rank, host=str(node["host"]),
                   pid=-1, time=0.0, returncode=None, role=str(node["role"]),
                   exc_type="AgentLost",
                   message=f"the agent of node {node_rank} ({node['host']}) stopped "
                           f"responding; its {counted(node['nproc'], 'worker')} are gone with it")


class StoreRendezvous(Rendezvous):
    """Rounds of agreement between a fixed set of agents; see the module docstring."""

    def __init__(self, cfg: LaunchConfig, secret: bytes) -> None:
        self._cfg = cfg
        self._timeout = cfg.conf("join_timeout", JOIN_TIMEOUT)
        self._held: socket.socket | None = None
        self._node = cfg.node_rank
        self._size = cfg.max_nodes  # nodes in the current round
        host, port = self._where = _endpoint(cfg)
        self.is_host = False
        if cfg.rdzv_backend == "c10d" or cfg.node_rank == 0:
            try:  # c10d: whoever can bind the endpoint hosts; the others connect
                self.store = TCPStore(host, port, is_master=True, wait_for_workers=False,
                                      timeout=self._timeout, secret=secret)
                self.is_host = True
            except NetworkError:
                if cfg.rdzv_backend == "static":
                    raise
        if not self.is_host:
            self.store = TCPStore(host, port, is_master=False, wait_for_workers=False,
                                  timeout=self._timeout, secret=secret)
        self.store.add("tandemrun/agents", 1)
        mine = (cfg.rdzv_id or uuid.uuid4().hex[:12]).encode()
        self.run_id = self.store.compare_set("tandemrun/run_id", b"", mine).decode()
        self._agent = uuid.uuid4().hex
        interval = cfg.conf("keep_alive_interval", 1.0)
        self._heartbeat = Heartbeat(self.store, self._agent, interval)
        self._watch = Watch(self.store, interval, int(cfg.conf("keep_alive_max_attempt", 5)))
        self._peers: dict[str, Failure] = {}  # agent id -> what to report if it is lost
        self._joining = 0  # the round being joined, for :meth:`waiting`

    def _key(self, attempt: int, name: str) -> str:
        return f"tandemrun/{attempt}/{name}"

    def _where_text(self) -> str:
        return f"{self._where[0]}:{self._where[1]}"

    def _info(self, restarts: int) -> bytes:
        return json.dumps({"host": socket.gethostname(), "nproc": self._cfg.nproc_per_node,
                           "role": self._cfg.role, "restarts": restarts,
                           "agent": self._agent}).encode()

    def waiting(self, seconds: float) -> str:
        n = self._cfg.nnodes
        joined = self.store.add(self._key(self._joining, "joined"), 0)
        return (f"still waiting for the other nodes after {seconds:.0f}s: {joined} of {n} "
                f"joined round {self._joining} of the rendezvous at {self._where_text()}; "
                f"{gives_up(self._timeout)}")

    def _join(self, attempt: int, restarts: int) -> tuple[int, int, int]:
        """Static: claim ``--node-rank`` and wait for all; (round, node rank, nodes)."""
        n = self._cfg.nnodes
        self._joining = attempt
        info = self._info(restarts)
        if self.store.compare_set(self._key(attempt, f"node/{self._node}"), b"", info) != info:
            raise ArgumentError(f"two agents claim --node-rank {self._node}; each node "
                                f"needs its own rank in [0, {n})")
        if self.store.add(self._key(attempt, "joined"), 1) == n:
            self.store.set(self._key(attempt, "complete"), b"1")
        try:
            self.store.wait([self._key(attempt, "complete")], self._timeout)
        except StoreTimeoutError as exc:
            joined = self.store.add(self._key(attempt, "joined"), 0)
            raise StoreTimeoutError(
                f"only {joined} of {n} nodes joined attempt {attempt} of the rendezvous at "
                f"{self._where_text()} within {secs(self._timeout)}s "
                f"(--rdzv-conf join_timeout=SECONDS)") from exc
        return attempt, self._node, n

    def _master_addr(self) -> str:
        if self._cfg.rdzv_backend == "static":
            return self._cfg.master_addr
        return self._cfg.local_addr or local_address(self._where[0])

    def next_round(self, attempt: int, restarts: int) -> Assignment:
        attempt, self._node, self._size = self._join(attempt, restarts)
        master_key = self._key(attempt, "master")
        if self._node == 0:
            addr = self._master_addr()
            if self._held is not None:
                self._held.close()
            self._held = reserve_port(addr, 0)
            self.store.set(master_key, json.dumps({"addr": addr,
                                                   "port": self._held.getsockname()[1]}))
        self.store.wait([master_key], self._timeout)
        master = json.loads(self.store.get(master_key))
        if self._cfg.rdzv_backend == "static" and not self.is_host and _wire.is_wildcard(
                master["addr"]):
            # node 0 was given --master-addr 0.0.0.0, so its rank 0 listens on every
            # interface: this node reaches it where it reaches node 0's store
            master["addr"] = self._where[0]
        nodes: list[dict[str, Any]] = [json.loads(self.store.get(self._key(attempt, f"node/{k}")))
                                       for k in range(self._size)]
        mine, me = nodes[self._node], self._node
        self._watch.reset()
        self._peers = {node["agent"]: _lost_agent(k, node, sum(n["nproc"] for n in nodes[:k]))
                       for k, node in enumerate(nodes) if k != me}
        same_role = [k for k in range(self._size) if nodes[k]["role"] == mine["role"]]
        return Assignment(
            run_id=self.run_id, attempt=attempt, node_rank=me, nnodes=self._size,
            restart_count=max(int(node.get("restarts", 0)) for node in nodes),
            rank_offset=sum(nodes[k]["nproc"] for k in range(me)),
            world_size=sum(node["nproc"] for node in nodes),
            role_rank_offset=sum(nodes[k]["nproc"] for k in same_role if k < me),
            role_world_size=sum(nodes[k]["nproc"] for k in same_role),
            master_addr=str(master["addr"]), master_port=int(master["port"]))

    def shared_store(self) -> tuple[Store, str]:
        host, port = self._where
        return self.store, f"{host}:{port}"

    def publish_failure(self, attempt: int, failures: list[Failure]) -> None:
        text = json.dumps([json.loads(f.to_json()) for f in failures])
        self.store.set(self._key(attempt, f"failures/{self._node}"), text)
        self.store.compare_set(self._key(attempt, "failed"), b"",
                               json.dumps({"node": self._node, "time": time.time()}))

    def remote_failed(self, attempt: int) -> bool:
        if self.store.check([self._key(attempt, "failed")]):
            return True
        for agent in self._watch.lost(list(self._peers)):
            lost = self._peers[agent]
            lost.time = time.time()
            self.store.compare_set(self._key(attempt, f"failures/{lost.node_rank}"), b"",
                                   json.dumps([json.loads(lost.to_json())]))
            self.store.compare_set(self._key(attempt, "failed"), b"",
                                   json.dumps({"node": lost.node_rank, "time": lost.time}))
        return self.store.check([self._key(attempt, "failed")])

    def remote_failures(self, attempt: int) -> list[Failure]:
        if not self.remote_failed(attempt):
            return []
        first = json.loads(self.store.get(self._key(attempt, "failed")))["node"]
        try:  # the first failing node publishes its records before it stops its workers
            self.store.wait([self._key(attempt, f"failures/{first}")], 5.0)
        except StoreTimeoutError:
            pass
        out = []
        for k in range(self._size):
            name = self._key(attempt, f"failures/{k}")
            if k != self._node and self.store.check([name]):
                out += [Failure.from_json(json.dumps(d)) for d in json.loads(self.store.get(name))]
        return out

    def finish(self, attempt: int, interval: float, abort: Callable[[], bool]) -> bool:
        done = self._key(attempt, "succeeded")
        self.store.add(done, 1)
        while True:
            if self.store.add(done, 0) >= self._size:
                return True
            if self.remote_failed(attempt) or abort():
                return False
            time.sleep(interval)

    def close(self) -> None:
        self._heartbeat.stop()
        if self._held is not None:
            self._held.close()
        try:
            self.store.add("tandemrun/left", 1)
            if self.is_host:  # the others still read the store until they leave
                wait_until(lambda: self.store.add("tandemrun/left", 0)
                           >= self.store.add("tandemrun/agents", 0), LEAVE_TIMEOUT, 0.05)
        except TandemError:
            pass  # the host already left; nothing more to say
        finally:
            self.store.close()
