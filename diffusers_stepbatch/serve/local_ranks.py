"""A server's other context-parallel ranks, started by the server itself on its own machine: a Ray Serve replica
that holds N GPUs is rank 0 and starts ranks 1..N-1 as processes beside it (torchrun does this for the CLI).

Each follower loads the same `ServeConfig`'s model and follows rank 0's model calls; it returns when rank 0
closes and fails (exits) when rank 0 is gone.

    python -m diffusers_stepbatch.serve.local_ranks '<ServeConfig as JSON>'     # with RANK, WORLD_SIZE, ... set
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys

from .config import ServeConfig, parse_context_parallel


def start_local_ranks(config: ServeConfig) -> list[subprocess.Popen]:
    """Make this process rank 0 of `config.context_parallel`'s ranks and start the others; their processes."""
    degrees = parse_context_parallel(config.context_parallel)
    world = degrees.get("ulysses_degree", 1) * degrees.get("ring_degree", 1)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ranks = dict(WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(ranks, RANK="0", LOCAL_RANK="0")
    described = json.dumps(dataclasses.asdict(config))
    return [subprocess.Popen([sys.executable, "-m", __name__, described],
                             env=dict(os.environ, **ranks, RANK=str(rank), LOCAL_RANK=str(rank)))
            for rank in range(1, world)]


def main() -> None:
    from .cli import follow_rank_0

    follow_rank_0(ServeConfig(**json.loads(sys.argv[1])))


if __name__ == "__main__":
    main()
