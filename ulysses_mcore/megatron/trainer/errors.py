"""What kind of failure an exception is: a collective that failed (a peer died, a connection broke,
a wait timed out) or an error of this rank's own.  Used by the trainer (to name the failure) and
by checkpoint saving (a collective failure is not a save failure to agree on: it is re-raised)."""

from __future__ import annotations

import torch.distributed as dist

# what torch.distributed's backends say when a peer dies, a connection breaks or a wait times out
COLLECTIVE_SIGNS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "timed out",
    "timeout",
    "nccl error",
    "ncclremoteerror",
    "ncclsystemerror",
    "gloo/transport",
    "socket closed",
    "connection refused",
)


def is_collective_failure(e: BaseException) -> bool:
    """A failed collective (peer death, broken connection, timeout), not a local error."""
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(sign in text for sign in COLLECTIVE_SIGNS)
