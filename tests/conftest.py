import os
import sys
import tempfile

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter so their logic is tested on CPU. It must be set before
# any kernel module is imported (triton.jit reads it at decoration time).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(__file__))
# draft length calibrations (engine/calibrate.py) of the tests' models go to a private directory, not ~/.cache
os.environ.setdefault("BLOCKSPEC_CACHE_DIR", tempfile.mkdtemp(prefix="blockspec-test-cache-"))
# Tiny test models run fastest single-threaded; more threads only add contention on the 2-core CI machine.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
