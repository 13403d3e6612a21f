"""Tensor parallelism's processes: the rendezvous, the worker processes, their watchdog.

Rank r runs on node r // ranks_per_node, on that node's device r % ranks_per_node.
Rank 0 (the engine's process on node 0) spawns the other ranks of its node; every
other node's `python -m server --headless` spawns all of its own. They join one
torch.distributed group through node 0's TCP store at master_addr:master_port: NCCL
on CUDA, gloo on CPU. A second, gloo group carries each step's header
(engine/step_channel.py): workers wait on it while the engine idles, so its
timeout is practically none, while the tensors' group times out a hung peer.

A thread watches the local workers' sentinels: a worker that exits unasked marks
the set failed at once, and the engine raises `WorkerFailed` at its next step or
idle check. A rank on another node that dies closes its sockets, so rank 0's
next collective fails.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.connection
import os
import socket
import threading
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.process import BaseProcess

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.distributed import GATE, TensorParallel, WorkerFailed
from engine.one_shot import OneShotAllReduce, rendezvous_made, unblock_until_drained

logger = logging.getLogger("pagoda.engine")

COLLECTIVE_TIMEOUT = timedelta(seconds=120)  # a peer that hangs inside a step
IDLE_TIMEOUT = timedelta(days=365)  # workers wait this long for the next step
# Spawned ranks inherit these: NVLink multicast stays off (it can wedge shared GPUs).
WORKER_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


@dataclass
class Membership:
    """What a rank holds once it has joined: its view of the group, the header's
    group, and the engine config every rank runs (rank 0's, with its own device)."""

    tp: TensorParallel
    control: dist.ProcessGroup  # gloo, no practical timeout
    config: EngineConfig


@dataclass(frozen=True)
class Rendezvous:
    """Where the group's TCP store listens. Node 0 holds the store open from the moment
    its port is chosen (port 0: the OS picks one) until the group is gone, so no other
    process can take the port in between. Spawned ranks get this by pickle."""

    host: str
    port: int

    def connect(self) -> dist.Store:
        """A client of the store; it retries until node 0's store is up (or times out)."""
        return dist.TCPStore(self.host, self.port, is_master=False, timeout=COLLECTIVE_TIMEOUT)


def host_rendezvous(host: str, port: int) -> tuple[dist.TCPStore, Rendezvous]:
    """Open the group's store on node 0, bound before anyone is told its port."""
    store = dist.TCPStore(
        host, port, is_master=True, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False
    )
    return store, Rendezvous(host, store.port)


def join(config: EngineConfig, rank: int, store: dist.Store) -> Membership:
    """Join the group as `rank` through the rendezvous store; every rank leaves with
    rank 0's engine config."""
    device = config.torch_device
    if device.type == "cuda":  # the node's device rank % ranks_per_node
        device = torch.device("cuda", (device.index or 0) + rank % config.ranks_per_node)
        torch.cuda.set_device(device)
    GATE.open()  # a new group: calls go through again
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=store,
        rank=rank,
        world_size=config.tensor_parallel_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    shared = [config]
    dist.broadcast_object_list(shared, src=0, group=control)
    if rank != 0:  # rank 0 keeps its own object: the engine and the server read it
        config = shared[0]
        config.device = str(device)
    layout: list[tuple | None] = [None] * config.tensor_parallel_size
    me = (rank, rank // config.ranks_per_node, socket.gethostname(), str(device), os.getpid())
    dist.all_gather_object(layout, me, group=control)
    if rank == 0:
        ranks = "; ".join(f"rank {r} node {n} ({h}) {d} pid {pid}" for r, n, h, d, pid in layout)
        logger.info(
            "tensor parallel: %d ranks on %d node(s), %d per node: %s",
            config.tensor_parallel_size,
            config.nnodes,
            config.ranks_per_node,
            ranks,
        )
    one_shot = _one_shot(config, device, control)
    tp = TensorParallel(rank, config.tensor_parallel_size, dist.group.WORLD, one_shot)
    return Membership(tp, control, config)


def _one_shot(
    config: EngineConfig, device: torch.device, control: dist.ProcessGroup
) -> OneShotAllReduce | None:
    """The one-shot all-reduce on every rank or on none: CUDA ranks of one node only."""
    if device.type != "cuda" or config.nnodes > 1 or not config.custom_all_reduce:
        return None
    made = rendezvous_made()
    if _min_over_ranks(made, control) != -_min_over_ranks(-made, control):
        if dist.get_rank() == 0:  # its workers are new processes, and torch cannot rejoin
            logger.info("all-reduces on NCCL: this process has had a tensor-parallel engine")
        return None
    if not _min_over_ranks(int(_peers_reachable(device, config)), control):
        if dist.get_rank() == 0:  # decided before creating: a rank left out would hang it
            logger.info("all-reduces on NCCL: not every GPU here can map the others' memory")
        return None
    try:
        one_shot = OneShotAllReduce.create(dist.group.WORLD, config.tensor_parallel_size, device)
    except Exception as exc:  # e.g. a driver that refuses the peer mappings
        logger.warning("one-shot all-reduce unavailable here: %s", exc)
        one_shot = None
    if not _min_over_ranks(int(one_shot is not None), control):
        return None  # some rank has none: NCCL for all, or the ranks' collectives differ
    if dist.get_rank() == 0:
        logger.info("all-reduces up to %d KiB: one-shot over peer memory", one_shot.max_bytes >> 10)
    return one_shot


def _peers_reachable(device: torch.device, config: EngineConfig) -> bool:
    """Whether this rank's GPU can map every other GPU of its node's ranks (peer access)."""
    first = device.index - dist.get_rank() % config.ranks_per_node
    peers = [first + i for i in range(config.ranks_per_node) if first + i != device.index]
    return all(torch.cuda.can_device_access_peer(device, peer) for peer in peers)


def _min_over_ranks(value: int, group: dist.ProcessGroup) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


def all_ranks_min(value: int, membership: Membership) -> int:
    """The smallest of every rank's value (over the gloo group: a dead peer fails it)."""
    return _min_over_ranks(value, membership.control)


def leave() -> None:
    """Leave the group (one that a dead rank broke, too: there is nothing left to save)."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            logger.exception("leaving the process group failed")


class Workers:
    """The local worker processes (spawned), and a thread watching them."""

    def __init__(
        self,
        config: EngineConfig,
        ranks: list[int],
        rendezvous: Rendezvous,
        exit_ok: bool = False,  # a headless node's ranks leave when rank 0 stops them
    ) -> None:
        from engine.tp_worker import worker_main  # the spawned side's entry point

        for key, value in WORKER_ENV.items():
            os.environ.setdefault(key, value)
        ctx = multiprocessing.get_context("spawn")
        self.processes = {
            rank: ctx.Process(
                target=worker_main,
                args=(config, rank, rendezvous),
                name=f"pagoda-tp-rank{rank}",
                daemon=True,
            )
            for rank in ranks
        }
        self.failure: str | None = None
        self.failed = threading.Event()
        self.stopping = False
        self.exit_ok = exit_ok
        for process in self.processes.values():
            process.start()
        # By sentinel: the workers not reaped yet (the watcher's to change).
        self.running: dict[int, tuple[int, BaseProcess]] = {
            p.sentinel: (rank, p) for rank, p in self.processes.items()
        }
        # Registered after multiprocessing's own exit handler, so it runs first: the
        # daemon workers that handler then terminates are not reported as failures.
        atexit.register(setattr, self, "stopping", True)
        self._watcher = threading.Thread(target=self._watch, name="pagoda-tp-watch", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        """The only thread that reaps the workers (two waitpid callers race: the loser
        would see a live process forever), so others wait for this one to end."""
        running = self.running
        while running:
            for sentinel in multiprocessing.connection.wait(list(running)):
                rank, process = running[sentinel]
                process.join()
                del running[sentinel]
                if self.stopping or (self.exit_ok and process.exitcode == 0):
                    continue
                if self.failure is None:
                    self.failure = (
                        f"tensor-parallel rank {rank} (pid {process.pid}) exited with code "
                        f"{process.exitcode} (its log says why)"
                    )
                    logger.error("%s", self.failure)
                    self.failed.set()
                    for _, other in list(running.values()):  # they cannot go on alone
                        other.kill()
                    GATE.abort(self.failure, self._abort_collectives)

    def _abort_collectives(self) -> None:
        """Device work waiting on the dead rank ends: the one-shot kernels' first, since
        NCCL's abort can wait for its own kernels queued behind them."""
        unblock_until_drained(COLLECTIVE_TIMEOUT.total_seconds())
        _abort_nccl()

    def check(self) -> None:
        if self.failure is not None:
            raise WorkerFailed(self.failure)

    def explain(self, exc: BaseException, wait_s: float = 2.0) -> None:
        """A collective failed: if a worker has died (or dies within wait_s: a peer's
        closed socket can be seen before its exit), raise that instead."""
        if self.failed.wait(wait_s):
            raise WorkerFailed(self.failure) from exc

    def join(self, timeout: float) -> None:
        """Wait for the workers to leave (asked to, or on their own); then make sure."""
        self.stopping = True
        self._watcher.join(timeout)
        if self._watcher.is_alive():
            for _, process in list(self.running.values()):
                process.kill()  # a signal, no wait: the watcher reaps it
            self._watcher.join(5.0)

    @property
    def alive(self) -> bool:
        """Some worker has not been reaped yet."""
        return self._watcher.is_alive()


def start_driver(config: EngineConfig) -> tuple[Workers, Membership]:
    """Rank 0: spawn this node's other ranks and join the group with them. Joining waits
    for every rank, so a local one that dies first must not hang it: then the others
    are stopped and WorkerFailed is raised."""
    if config.node_rank != 0:
        raise ValueError("only node 0 runs the engine; other nodes run --headless")
    store, rendezvous = host_rendezvous(config.master_addr, config.master_port)
    workers = Workers(config, list(range(1, config.ranks_per_node)), rendezvous)
    joined: list[Membership | BaseException] = []  # the thread's result, or what it raised

    def join_group() -> None:
        try:
            joined.append(join(config, 0, store))
        except BaseException as exc:
            joined.append(exc)

    thread = threading.Thread(target=join_group, daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.1)
        if workers.failure is not None:
            workers.join(timeout=10.0)
            leave()
            workers.check()
    if isinstance(joined[0], BaseException):
        try:
            workers.explain(joined[0])  # a rank's death, if that is what failed
        finally:
            workers.join(timeout=10.0)
            leave()
        raise joined[0]
    return workers, joined[0]


def _abort_nccl() -> None:
    """Abort this process's NCCL communicators, so that device work waiting on a dead
    rank ends (and the engine thread's next wait returns) instead of hanging until
    the group's timeout. gloo needs none: a dead peer's closed sockets fail it."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is None or not dist.is_initialized() or dist.get_backend() != "nccl":
        return
    try:
        abort()
    except Exception:
        logger.exception("aborting the NCCL communicators failed")
