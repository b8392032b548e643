"""What kind of failure an exception is: a collective that failed (a peer died, a connection broke,
a wait timed out) or an error of this rank's own.  Used by the trainer (to name the failure) and
by checkpoint saving (a collective failure is not a save failure to agree on: it is re-raised);
and NaN / Inf in a step, found with one reduced check and named alike on every rank."""

from __future__ import annotations

import math

import torch
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


class NonFiniteError(FloatingPointError):
    """NaN or Inf in the loss or the gradients (raised on every rank alike)."""


def gradient_buffers(model):
    """The gradient storage: DDP's flat buffers when there are any, else each parameter's gradient."""
    # DDP keeps its buffers in lists named buffers / expert_parallel_buffers (on a bare module,
    # "buffers" is nn.Module's method: not a list, so it is skipped)
    lists = [getattr(model, n, None) for n in ("buffers", "expert_parallel_buffers")]
    bufs = [
        b.grad_data for lst in lists if isinstance(lst, list) for b in lst if getattr(b, "grad_data", None) is not None
    ]
    grads = (_local_grad(p) for p in _core(model).parameters())
    return bufs or [g for g in grads if g is not None]


def _local_grad(p):
    """A parameter's gradient as this rank holds it: Megatron's main_grad, else its grad (FSDP2's
    shard of it, a DTensor, as the local tensor)."""
    g = getattr(p, "main_grad", None)
    g = p.grad if g is None else g
    return g.to_local() if hasattr(g, "to_local") else g


def _core(model):
    """What holds the named parameters: DDP's module, or the model (a stage's chunks) itself."""
    return getattr(model, "module", model)


def nonfinite_report(model, loss: float, iteration):
    """(bad?, message): one reduced check per step -- finiteness of the gradient buffers on the
    device, one all-reduce, one read on the host; every rank agrees and names the first bad rank."""
    grads = gradient_buffers(model)
    dev = "cuda" if dist.get_backend() == "nccl" else "cpu"
    finite = torch.stack([torch.isfinite(g).all() for g in grads]).all() if grads else torch.tensor(True)
    bad = (~finite.to(dev)) | (not math.isfinite(loss))
    rank = dist.get_rank()
    # encode (bad, -rank) so MAX picks the lowest bad rank
    flag = torch.stack([bad.double(), torch.where(bad, -float(rank), -1e9).double()]).to(dev)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    any_bad, neg_first = flag.tolist()
    if any_bad == 0:
        return False, ""
    where = ""
    if bool(bad):  # a bad step: find what, on this rank (host work only now)
        what = (
            "loss"
            if not math.isfinite(loss)
            else next(
                (
                    f"gradient of {n}"
                    for n, p in _core(model).named_parameters()
                    if getattr(p, "main_grad", None) is not None and not torch.isfinite(p.main_grad).all()
                ),
                "gradients",
            )
        )
        where = f"; on this rank: {what}"
    return True, f"iteration {iteration}: NaN/Inf in the loss or gradients, first on rank {int(-neg_first)}{where}"
