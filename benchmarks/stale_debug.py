"""Run the stale-read test's worker in this process with the side streams' producer wait
removed, printing what each path read (debugging aid for tests/test_gpu_stale_read.py)."""

import os
import sys

os.environ["TORCHREFIT_BREAK_PRODUCER_WAIT"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from test_gpu_stale_read import _stale_read  # noqa: E402

from torchrefit.bench.world import one_gpu_world
from torchrefit.testing import Mesh  # noqa: E402

if __name__ == "__main__":
    one_gpu_world(29566)
    for graph in (False, True):
        stale = _stale_read(0, 1, Mesh(1, ranks=1), Mesh(1, ranks=1), "nccl", graph)
        print(f"broken wait, 1 process, cuda_graph={graph}: {len(stale)} stale tensors {stale[:2]}")
