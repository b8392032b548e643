"""Helper processes die with the rank that started them.

A rank killed by the scheduler (SIGKILL: a node drain, an OOM kill, a failed peer's job teardown)
runs no cleanup, so a process it started -- Megatron's checkpoint writers (forked per save), the
multiprocessing Manager that collects their results (a spawned server kept for the run) -- would
be re-parented to init and live on, holding memory on the node.  On Linux the kernel's
parent-death signal ends them with their rank: :func:`die_with_parent` sets it in a child (also
as a ``multiprocessing`` initializer), :func:`children_die_with_this_process` in every child this
process forks from Python.  Elsewhere both do nothing.  Standard library only (a spawned helper
imports this module, not torch).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
_REGISTERED = []


def die_with_parent() -> None:
    """In a child process: SIGKILL when the parent (the thread that started it) ends; if the parent
    is already gone, exit now."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent or parent == 1:  # the parent died before the signal was armed
        os._exit(1)


def children_die_with_this_process() -> None:
    """Every child this process forks from Python (``os.fork``, ``multiprocessing``'s fork context)
    gets the parent-death signal (once per process)."""
    if not _REGISTERED and sys.platform.startswith("linux") and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=die_with_parent)
        _REGISTERED.append(True)


__all__ = ["die_with_parent", "children_die_with_this_process"]
