"""Helper processes die with the process that started them (ulysses_mcore.devtools.lifetime): a parent
killed with SIGKILL -- no cleanup runs -- leaves no forked child and no spawned Manager server
behind; without the parent-death signal the same child outlives it (the negative control)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARENT = textwrap.dedent("""
    import multiprocessing as mp, os, sys, time
    from multiprocessing.managers import SyncManager
    from ulysses_mcore.devtools import lifetime

    def sleeper():
        time.sleep(120)

    if __name__ == "__main__":
        kind, armed = sys.argv[1], sys.argv[2] == "armed"
        if kind == "fork":
            if armed:
                lifetime.children_die_with_this_process()
            child = mp.get_context("fork").Process(target=sleeper)
            child.start()
            pid = child.pid
        else:  # a spawned Manager server, as Megatron's checkpoint writer keeps one
            manager = SyncManager(ctx=mp.get_context("spawn"))
            manager.start(initializer=lifetime.die_with_parent if armed else None)
            pid = manager._process.pid
        print(pid, flush=True)
        time.sleep(120)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
@pytest.mark.parametrize("kind", ["fork", "spawned-manager"])
def test_a_killed_parent_takes_its_helpers_with_it(tmp_path, kind):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    env = dict(os.environ, PYTHONPATH=ROOT)
    survivors = {}
    for armed in ("armed", "unarmed"):
        parent = subprocess.Popen(
            [sys.executable, str(script), kind, armed], stdout=subprocess.PIPE, text=True, env=env
        )
        child = int(parent.stdout.readline())
        assert _alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.time() + 10
        while _alive(child) and time.time() < deadline:
            time.sleep(0.1)
        survivors[armed] = _alive(child)
        if survivors[armed]:
            os.kill(child, signal.SIGKILL)
    assert survivors == {"armed": False, "unarmed": True}
