"""Tensor-parallel worker ranks joined by torch.distributed: NCCL for the model's collectives on CUDA,
gloo on CPU (through shared memory where every rank is on this host: shm_collectives.py), and gloo
groups besides for the control plane (step plans) and liveness.

Rank 0 is the worker the scheduler talks to: it receives every message on its ZeroMQ socket and
broadcasts the frame to the other ranks, which may be on other hosts; only rank 0 answers. Every rank
then runs the same step, sampling included, on logits gathered whole on every rank (the same logits
and the same seeded generator), and keeps the tokens rank 0 sampled, so every rank's request mirrors
stay equal.

A rank that dies closes its connections: the others' next collective fails (RankLost, which stops the
worker as a device fault does), and a heartbeat on a group of its own notices it while the server is
idle, within a second.
"""

from __future__ import annotations

import datetime
import logging
import os
import platform
import threading
import time

import torch
import torch.distributed as dist

from crane_mp.parallel import ParallelConfig
from crane_mp.worker.parallel.shm_collectives import SharedMemoryCollectives
from crane_mp.worker.platforms.device import RankLost

log = logging.getLogger("crane_mp.worker")

# Ranks other than 0 wait in a broadcast for the next message however long the server idles: no
# timeout it could reach. A dead peer fails a collective at once (its connections close); the
# heartbeat's own timeout catches a peer that hangs.
_WAIT_FOREVER = datetime.timedelta(days=10000)
_HEARTBEAT_SECONDS = 1.0
_HEARTBEAT_TIMEOUT = datetime.timedelta(seconds=30)
# A step plan fits one broadcast of this many bytes (its length first); a longer frame takes a second.
_FRAME_BYTES = 8192
_LENGTH_BYTES = 8
# Each rank's slot for the shared-memory collectives: a decode step's hidden states and logits fit;
# larger tensors (long prompt chunks, whose arithmetic dwarfs gloo's latency) go through gloo.
_SHARED_SLOT_BYTES = 16 << 20


# Set once this process joins its ranks on one host's CPU (TensorParallel); None: gloo or NCCL only.
_SHARED: SharedMemoryCollectives | None = None


def _lost(err: RuntimeError) -> RankLost:
    return RankLost(f"a tensor-parallel collective failed: {err}")


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place (row-parallel outputs, the vocabulary-parallel embedding)."""
    if _SHARED is not None and _SHARED.fits(x):
        return _SHARED.all_reduce(x)
    try:
        dist.all_reduce(x)
    except RuntimeError as err:
        raise _lost(err) from err
    return x


def gather_columns(x: torch.Tensor, width: int) -> torch.Tensor:
    """Every rank's [rows, columns] side by side, cut to `width` columns (the logits of the whole vocabulary)."""
    if _SHARED is not None and _SHARED.fits(x):
        return _SHARED.gather_columns(x)[:, :width]
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    try:
        dist.all_gather(parts, x.contiguous())
    except RuntimeError as err:
        raise _lost(err) from err
    return torch.cat(parts, dim=1)[:, :width]


def split_cores(local_rank: int, local_ranks: int, sys_root: str = "/sys/devices/system") -> set[int] | None:
    """The CPU cores of `local_rank` among `local_ranks` on this host, of the ones this process may use:
    whole NUMA nodes per rank, or an even share of one node's (so that a rank's memory, touched first by
    its own threads, is local to them), else an even share of them all; a share is whole physical
    cores, both hyperthreads of each, never half of one shared with another rank. None where there are
    fewer cores than ranks (they share them all)."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < local_ranks:
        return None
    nodes = [cores for cores in _numa_nodes(os.path.join(sys_root, "node"), set(allowed)) if cores] or [allowed]
    if len(nodes) % local_ranks == 0:
        per_rank = len(nodes) // local_ranks
        return {core for cores in nodes[local_rank * per_rank : (local_rank + 1) * per_rank] for core in cores}
    if local_ranks % len(nodes) == 0:
        per_node = local_ranks // len(nodes)
        return _share(nodes[local_rank // per_node], local_rank % per_node, per_node, sys_root)
    return _share(allowed, local_rank, local_ranks, sys_root)


def _share(cpus: list[int], index: int, count: int, sys_root: str) -> set[int]:
    """Share `index` of `count` of `cpus`: whole physical cores where there are enough, else logical CPUs."""
    cores = _physical_cores(cpus, sys_root)
    if len(cores) >= count:
        per = len(cores) // count
        return {cpu for core in cores[index * per : (index + 1) * per] for cpu in core}
    per = max(1, len(cpus) // count)
    return set(cpus[index * per : (index + 1) * per]) or {cpus[index % len(cpus)]}


def _physical_cores(cpus: list[int], sys_root: str) -> list[list[int]]:
    """`cpus` grouped by physical core (sysfs thread_siblings_list), by first CPU; one each where unknown."""
    wanted, cores, seen = set(cpus), [], set()
    for cpu in cpus:
        if cpu in seen:
            continue
        siblings = _cpu_list(os.path.join(sys_root, "cpu", f"cpu{cpu}", "topology", "thread_siblings_list"))
        core = sorted((set(siblings or [cpu]) & wanted) | {cpu})
        seen.update(core)
        cores.append(core)
    return cores


def _cpu_list(path: str) -> list[int] | None:
    """A sysfs CPU list file ("0-3,8-11"), or None where there is none."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    cpus = []
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        cpus += range(int(first), int(last or first) + 1)
    return cpus


def _numa_nodes(root: str, allowed: set[int]) -> list[list[int]]:
    """Each NUMA node's allowed cores, in node order; [] where unknown."""
    try:
        names = sorted((n for n in os.listdir(root) if n.startswith("node") and n[4:].isdigit()),
                       key=lambda n: int(n[4:]))
    except OSError:
        return []
    nodes = []
    for name in names:
        cpus = _cpu_list(os.path.join(root, name, "cpulist"))
        if cpus is None:
            return []
        nodes.append(sorted(c for c in cpus if c in allowed))
    return nodes


class TensorParallel:
    """This process's place among the ranks, and the groups that connect them."""

    def __init__(self, parallel: ParallelConfig, rank: int, run_dir: str, device: torch.device) -> None:
        self.parallel = parallel
        self.rank = rank
        self.size = parallel.tensor_parallel_size
        self.device = device
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=parallel.init_method(run_dir), rank=rank, world_size=self.size,
                                timeout=_WAIT_FOREVER)
        # The control plane's gloo group; on CPU the default group is one already.
        self._control = dist.new_group(backend="gloo", timeout=_WAIT_FOREVER) if backend != "gloo" else None
        self._heartbeat = dist.new_group(backend="gloo", timeout=_HEARTBEAT_TIMEOUT)
        # Run-time LoRA loads agree on their outcome from each rank's loading thread.
        self._adapters = dist.new_group(backend="gloo", timeout=_WAIT_FOREVER)
        self._stopping = threading.Event()
        # Shared memory's flags are read in the order they were written on x86 only.
        if device.type == "cpu" and parallel.nnodes == 1 and platform.machine() in ("x86_64", "AMD64"):
            self._share_memory(run_dir)
        # From here on, loading included: a rank waiting in a collective learns of a peer's death.
        self._start_heartbeat()

    def _share_memory(self, run_dir: str) -> None:
        """The ranks' shared mapping: rank 0 makes the file (its pages reserved now: a /dev/shm too small,
        as in a container, falls back to gloo instead of failing a step later), every rank maps it, then
        it is unlinked, so nothing is left behind however the ranks end."""
        global _SHARED
        root = "/dev/shm" if os.path.isdir("/dev/shm") else run_dir
        path = os.path.join(root, f"crane-mp-{os.path.basename(run_dir)}-collectives")
        try:
            made = 1
            if self.rank == 0:
                try:
                    _SHARED = SharedMemoryCollectives(path, 0, self.size, _SHARED_SLOT_BYTES, create=True)
                except OSError as err:
                    log.warning("no shared memory for the ranks' collectives (%s); they go through gloo", err)
                    made = 0
            if self.agree_min([made]) == [1] and self.rank != 0:
                _SHARED = SharedMemoryCollectives(path, self.rank, self.size, _SHARED_SLOT_BYTES, create=False)
            self._barrier()
        finally:
            if self.rank == 0 and os.path.exists(path):
                os.unlink(path)

    def _barrier(self) -> None:
        try:
            dist.barrier(group=self._control)
        except RuntimeError as err:
            raise _lost(err) from err

    # ---- the control plane --------------------------------------------------------------------

    def _broadcast(self, tensor: torch.Tensor) -> None:
        try:
            dist.broadcast(tensor, 0, group=self._control)
        except RuntimeError as err:
            raise _lost(err) from err

    def send_frame(self, frame: bytes) -> None:
        """Rank 0: hand a message's bytes to every other rank."""
        head = torch.zeros(_FRAME_BYTES, dtype=torch.uint8)
        head[:_LENGTH_BYTES] = torch.tensor([len(frame)], dtype=torch.int64).view(torch.uint8)
        first = frame[: _FRAME_BYTES - _LENGTH_BYTES]
        head[_LENGTH_BYTES : _LENGTH_BYTES + len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
        self._broadcast(head)
        if len(frame) > len(first):
            self._broadcast(torch.frombuffer(bytearray(frame[len(first) :]), dtype=torch.uint8))

    def receive_frame(self) -> bytes:
        """Ranks but 0: the next message's bytes, waiting as long as it takes."""
        head = torch.empty(_FRAME_BYTES, dtype=torch.uint8)
        self._broadcast(head)
        length = int(head[:_LENGTH_BYTES].view(torch.int64).item())
        first = head[_LENGTH_BYTES : _LENGTH_BYTES + length].numpy().tobytes()
        if length <= len(first):
            return first
        rest = torch.empty(length - len(first), dtype=torch.uint8)
        self._broadcast(rest)
        return first + rest.numpy().tobytes()

    def first_rank_tokens(self, tokens: list[int]) -> list[int]:
        """Rank 0's sampled tokens, on every rank. Every rank samples the same logits with the same seeded
        generator, but a reduction over the vocabulary on another number of threads (hosts with other
        core counts) can round differently and, once in a long while, pick another token: every rank's
        request mirrors and sampling state follow rank 0's."""
        ids = torch.tensor(tokens, dtype=torch.int64)
        if _SHARED is not None and _SHARED.fits(ids):
            return _SHARED.from_first(ids).tolist()
        self._broadcast(ids)
        return ids.tolist()

    def loaded_on_every_rank(self, loaded: bool) -> bool:
        """Whether every rank loaded the adapter its loading thread just tried (the threads take loads in
        the same order on every rank)."""
        flag = torch.tensor([int(loaded)])
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._adapters)
        except RuntimeError as err:
            raise _lost(err) from err
        return bool(flag.item())

    def agree_min(self, values: list[int]) -> list[int]:
        """Each value's minimum over the ranks (the KV blocks and sequence length every rank can hold)."""
        tensor = torch.tensor(values, dtype=torch.int64)
        try:
            dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self._control)
        except RuntimeError as err:
            raise _lost(err) from err
        return tensor.tolist()

    def gather_facts(self, values: list[int]) -> list[list[int]]:
        """Every rank's `values` (the same count on each), by rank."""
        tensor = torch.tensor(values, dtype=torch.int64)
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor, group=self._control)
        return [part.tolist() for part in parts]

    # ---- liveness -----------------------------------------------------------------------------

    def _start_heartbeat(self) -> None:
        """Beat with every other rank each second; a failed beat ends this process (exit 1), unless it
        is stopping on purpose. The launcher then stops the rest of the server."""
        threading.Thread(target=self._beat, name="tp-heartbeat", daemon=True).start()

    def leave(self) -> None:
        """Every rank is leaving (the scheduler's ShutdownWorker reached all): once all of them know, so
        that no heartbeat takes a closing peer for a fault."""
        self._stopping.set()
        self._barrier()

    def _beat(self) -> None:
        token = torch.zeros(1)
        while not self._stopping.is_set():
            try:
                dist.all_reduce(token, group=self._heartbeat)
            except RuntimeError as err:
                if self._stopping.is_set():
                    return
                log.error("tensor-parallel rank %d lost a peer rank (%s); stopping", self.rank,
                          str(err).splitlines()[0])
                logging.shutdown()
                os._exit(1)
            time.sleep(_HEARTBEAT_SECONDS)
