"""`python -m pagedmoe.parallel.worker RANK PORT`: one spawned rank (parallel/launch.py starts it with the
engine's config, pickled, in PAGEDMOE_TP_CONFIG)."""
from __future__ import annotations

import base64
import os
import pickle
import sys

from pagedmoe.parallel.launch import worker_main

if __name__ == "__main__":
    config = pickle.loads(base64.b64decode(os.environ.pop("PAGEDMOE_TP_CONFIG")))
    worker_main(config, int(sys.argv[1]), int(sys.argv[2]))
