import os
import time

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
# every process the suite starts inherits this mark: at the end none of them may still be alive
SESSION_MARK = f"ULYSSES_MCORE_TEST_SESSION={os.getpid()}"
os.environ["ULYSSES_MCORE_TEST_SESSION"] = str(os.getpid())


def _own_helper(pid: int, ppid: int) -> bool:
    """multiprocessing's resource tracker of this very process: it ends when this process does."""
    if ppid != os.getpid():
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"multiprocessing.resource_tracker" in f.read()
    except OSError:
        return False


def processes_of_this_session():
    """PIDs (not this one) whose environment carries this session's mark, zombies aside."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else []):
        if int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat") as f:
                state, ppid = f.read().split(")")[-1].split()[:2]
        except OSError:
            continue
        if SESSION_MARK.encode() in env and state != "Z" and not _own_helper(int(pid), int(ppid)):
            found.append(int(pid))
    return found


@pytest.fixture(scope="session", autouse=True)
def no_process_outlives_the_suite():
    """After the last test: no process the suite started (spawned ranks, torchrun agents, their
    helpers) is alive -- a rank that dies takes what it started with it."""
    yield
    deadline = time.time() + 15
    while processes_of_this_session() and time.time() < deadline:
        time.sleep(0.5)
    left = processes_of_this_session()
    details = []
    for pid in left:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            details.append(f"{pid}: {cmdline[:200]}")
        except OSError:
            pass
    assert not left, "processes started by the suite outlived it:\n" + "\n".join(details)


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
