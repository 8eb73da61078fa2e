"""`python -m pagedmoe.parallel.worker RANK PORT`: one spawned rank (parallel/launch.py starts it with the
engine's config, pickled, in PAGEDMOE_TP_CONFIG): join rank 0's group, start the same engine, serve rank 0's
steps until it shuts down; it exits when rank 0's process is gone."""
from __future__ import annotations

import base64
import os
import pickle
import sys

from pagedmoe.engine.startup import start_engine
from pagedmoe.parallel.launch import exit_worker, join_group, serve_steps, watch_parent


def worker_main(config, rank: int, port: int) -> None:
    join_group(config, rank, port)
    serve_steps(start_engine(config))
    exit_worker()


if __name__ == "__main__":
    watch_parent(int(os.environ.pop("PAGEDMOE_TP_PARENT")))
    worker_main(pickle.loads(base64.b64decode(os.environ.pop("PAGEDMOE_TP_CONFIG"))), int(sys.argv[1]),
                int(sys.argv[2]))
