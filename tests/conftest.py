import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none here); runs on GPU nodes via tools/device_check.sh")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
