"""How the model is split over worker ranks and hosts (--tensor-parallel-size, --nnodes, --node-rank,
--dist-init-addr: SGLang's spellings). Torch-free: the launcher and CLI read it."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None  # HOST:PORT where node 0's rank 0 gathers the ranks (nnodes > 1)

    def __post_init__(self) -> None:
        size, nodes = self.tensor_parallel_size, self.nnodes
        if size < 1 or nodes < 1:
            raise ValueError("--tensor-parallel-size and --nnodes must be at least 1")
        if size % nodes:
            raise ValueError(f"--tensor-parallel-size {size} must be a multiple of --nnodes {nodes}: every node "
                             "runs as many ranks")
        if not 0 <= self.node_rank < nodes:
            raise ValueError(f"--node-rank must be in [0, {nodes - 1}] with --nnodes {nodes}")
        if nodes > 1 and not self.dist_init_addr:
            raise ValueError("--nnodes above 1 needs --dist-init-addr HOST:PORT, node 0's address every node "
                             "can reach")
        if self.dist_init_addr is not None:
            self.init_host_port()

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        """The global ranks this node runs."""
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)

    def init_host_port(self) -> tuple[str, int]:
        host, sep, port = (self.dist_init_addr or "").rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--dist-init-addr {self.dist_init_addr!r}: give HOST:PORT, e.g. 10.0.0.1:5000")
        return host, int(port)

    def init_method(self, run_dir: str) -> str:
        """torch.distributed's rendezvous: node 0's TCP store across hosts, else a file in the launcher's
        private run directory (no port to pick or collide on)."""
        if self.dist_init_addr is None:
            return f"file://{run_dir}/tensor-parallel-rendezvous"
        host, port = self.init_host_port()
        return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"

    def on_loopback(self) -> bool:
        """Every rank is on this host's loopback: gloo must listen there too, whatever the hostname resolves to."""
        if self.dist_init_addr is None:
            return True
        host = self.init_host_port()[0]
        if host == "localhost":
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False

    def describe(self) -> str:
        return f"tp={self.tensor_parallel_size} nodes={self.nnodes}"
