"""The exchange's transport: the one all-to-all of the package and the pool of buffers it fills.

A steady-state call takes its send and receive buffers from :data:`POOL` (per thread, by size
class, bounded in bytes), so a new sequence length reuses the memory of the last one.
"""

from __future__ import annotations

import math
import threading

import torch
import torch.distributed as dist


def _unreferenced(buf: torch.Tensor) -> bool:
    """True when nothing but the pool holds ``buf``'s storage (the temporary storage object
    made here accounts for the second reference)."""
    return torch._C._storage_Use_Count(buf.untyped_storage()._cdata) == 2


def size_class(n: int) -> int:
    """``n`` elements rounded up to a power of two: shapes within a factor of two share buffers (a
    buffer's pages past what a call writes are never touched, so they cost address space, not memory)."""
    return 1 << max(0, (n - 1).bit_length())


class BufferPool(threading.local):
    """A free list of CPU buffers for the exchange, per thread, by size class (:func:`size_class`),
    bounded in bytes (``max_bytes``: the classes used longest ago go first; at most ``per_size`` a
    class).  A buffer is handed out as a view of the shape asked for when nothing else references its
    storage.  CUDA tensors and buffers under ``min_bytes`` bypass it; ``enabled = False`` turns it
    off; :meth:`clear` returns the memory (why: docs/design.md, "CPU buffer pool")."""

    per_size = 64
    min_bytes = 1 << 17  # below glibc's mmap threshold (128 KB) malloc reuses its heap: nothing to save
    max_bytes = 1 << 30

    def __init__(self):
        self.free_lists: dict = {}  # (elements, dtype) -> flat buffers, the class used last at the end
        self.held = 0
        self.enabled = hasattr(torch._C, "_storage_Use_Count")

    def take(self, shape: tuple, dtype, device: torch.device) -> torch.Tensor:
        n = math.prod(shape)
        if not self.enabled or device.type != "cpu" or n * dtype.itemsize < self.min_bytes:
            return torch.empty(shape, dtype=dtype, device=device)
        key = (size_class(n), dtype)
        bufs = self.free_lists.pop(key, [])
        self.free_lists[key] = bufs  # now the most recently used class
        for buf in bufs:
            if _unreferenced(buf):
                return buf[:n].view(shape)
        nbytes = key[0] * dtype.itemsize
        self._release_idle(nbytes, key)  # idle buffers of other classes make room for this one first
        buf = torch.empty(key[0], dtype=dtype, device=device)
        if len(bufs) < self.per_size and self._room(nbytes, key):
            bufs.append(buf)
            self.held += nbytes
        return buf[:n].view(shape)

    def _release_idle(self, nbytes: int, key) -> None:
        """Free up to ``nbytes`` of buffers nothing uses in the classes used longest ago (not ``key``):
        a run whose shapes change keeps about one working set, not one per class."""
        for old in list(self.free_lists):
            if nbytes <= 0 or old == key:
                return
            keep = []
            for buf in self.free_lists[old]:
                if nbytes > 0 and _unreferenced(buf):
                    size = buf.numel() * buf.element_size()
                    self.held, nbytes = self.held - size, nbytes - size
                else:
                    keep.append(buf)
            self.free_lists[old] = keep

    def _room(self, nbytes: int, key) -> bool:
        """Drop the classes used longest ago (not ``key``) until ``nbytes`` more fit under ``max_bytes``."""
        for old in list(self.free_lists):
            if self.held + nbytes <= self.max_bytes or old == key:
                break
            for buf in self.free_lists.pop(old):
                self.held -= buf.numel() * buf.element_size()
        return self.held + nbytes <= self.max_bytes

    def clear(self):
        self.free_lists.clear()
        self.held = 0


POOL = BufferPool()


# ----------------------------------------------------------------------------- the collective
def all_to_all(out: torch.Tensor, inp: torch.Tensor, group, out_splits=None, in_splits=None, *, async_op=False):
    """The one all-to-all of the package (split sizes in elements of flat buffers, or None)."""
    if out_splits is not None:
        out, inp = out.view(-1), inp.reshape(-1)
    return dist.all_to_all_single(
        out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group, async_op=async_op
    )


def is_fake_group(group) -> bool:
    """Whether ``group`` runs on torch's ``"fake"`` backend (``FakeStore``): collectives return
    shapes, not peers' data."""
    return dist.get_backend(group) == "fake"
