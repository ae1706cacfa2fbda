"""Starting ``xronos worker`` under torchrun agents on this host, as separate machines."""

from __future__ import annotations

import socket
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def static_agent(nnodes: int, node: int, port: int, args: list[str]) -> list[str]:
    """One torchrun agent (one worker) of a static rendezvous on loopback, running
    ``xronos worker ARGS``."""
    return [
        *(sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes)),
        *("--nproc-per-node", "1", "--node-rank", str(node)),
        *("--master-addr", "127.0.0.1", "--master-port", str(port)),
        *("-m", "xronos", "worker", *args),
    ]
