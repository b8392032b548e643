import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")


# fixtures that start a spawned world (or a trainer run) for the tests that use them
WORLD_FIXTURES = {"world", "runs", "base"}


def pytest_collection_modifyitems(config, items):
    """Spawned worlds and Megatron-LM runs are ``slow`` (``pytest -m "not slow"``: the pure-math and
    threaded tiers alone); GPU tests skip without CUDA."""
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none here); runs on GPU nodes via tools/device_check.sh")
    for item in items:
        if "spawn" in item.keywords or WORLD_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)
