"""Test launchers and independent references.

* :func:`run_threaded` -- a world of ``n`` threads on torch's ``threaded`` backend: real
  collectives (all_to_all_single, all_gather, ...) between threads, milliseconds to start.
* :func:`run_spawned` -- a real gloo world of ``n`` processes (free port, retried on
  "address in use"); each rank's exception is re-raised here naming the rank.
* :func:`reference_attention` -- float64 softmax attention written out by hand over the
  whole sequence (no SDPA): the oracle every parallel result is compared with.
* :func:`reference_seq_to_head` / :func:`shard_tokens` -- what the exchange must deliver, by
  plain indexing (no collective).
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import time
import threading
import traceback
from typing import Callable, List, Optional

import torch
import torch.distributed as dist


# ----------------------------------------------------------------------------- threads
def run_threaded(world_size: int, fn: Callable, *args, timeout: float = 120.0) -> List:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` threads joined by the threaded
    backend; return the per-rank results, or raise the first rank's exception."""
    from torch.testing._internal.distributed.multi_threaded_pg import (
        ProcessLocalGroup,
        _install_threaded_pg,
        _uninstall_threaded_pg,
    )

    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    world = _install_threaded_pg()
    store = dist.HashStore()
    results: List = [None] * world_size
    errors: List = [None] * world_size

    def worker(rank):
        dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
        try:
            results[rank] = fn(rank, world_size, *args)
        except BaseException as ex:  # noqa: BLE001 - re-raised in the caller
            errors[rank] = (ex, traceback.format_exc())
            ProcessLocalGroup.exception_handle(ex)
        finally:
            if world == dist.distributed_c10d._world:
                dist.destroy_process_group()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(world_size)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
            if t.is_alive():
                raise TimeoutError(f"threaded world of {world_size} did not finish in {timeout}s")
    finally:
        ProcessLocalGroup.reset()
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    # Prefer the first "real" error over the ones peers got from the termination signal.
    real = [(r, e) for r, e in enumerate(errors) if e is not None and "Terminate" not in type(e[0]).__name__]
    for r, e in real or [(r, e) for r, e in enumerate(errors) if e is not None]:
        raise RankError(r, e[0], e[1]) from e[0]
    return results


def run_threaded_errors(world_size: int, fn: Callable, *args) -> List[Optional[BaseException]]:
    """Like :func:`run_threaded` but return each rank's exception (or None) instead of raising."""

    def wrapped(rank, ws, *a):
        try:
            fn(rank, ws, *a)
        except Exception as ex:  # noqa: BLE001
            return ex
        return None

    return run_threaded(world_size, wrapped, *args)


class RankError(RuntimeError):
    def __init__(self, rank, exc, tb):
        super().__init__(f"rank {rank} failed: {type(exc).__name__}: {exc}\n{tb}")
        self.rank = rank
        self.exc = exc


# ----------------------------------------------------------------------------- processes
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent(parent_pid: Optional[int] = None) -> None:
    """Linux: this process gets SIGKILL when its parent dies (a killed pytest leaves no orphan
    ranks).  A no-op elsewhere."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if parent_pid is not None and os.getppid() != parent_pid:  # the parent died before prctl
        os._exit(1)


def _spawn_entry(rank, world_size, port, fn, args, queue, parent_pid=None):
    die_with_parent(parent_pid)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group(os.environ.get("ULYSSES_TEST_BACKEND", "gloo"), rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args)
        queue.put((rank, "ok", out))
    except BaseException as ex:  # noqa: BLE001
        queue.put((rank, "error", f"{type(ex).__name__}: {ex}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_spawned(world_size: int, fn: Callable, *args, timeout: float = 600.0, retries: int = 3):
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes; return results.

    One deadline for the whole world (``timeout`` seconds from the start, not per rank); ranks
    still alive then are killed, and every rank dies with this process."""
    import time

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    for attempt in range(retries):
        queue = ctx.SimpleQueue()
        port = free_port()
        procs = [
            ctx.Process(target=_spawn_entry, args=(r, world_size, port, fn, args, queue, os.getpid()))
            for r in range(world_size)
        ]
        deadline = time.monotonic() + timeout
        for p in procs:
            p.start()
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
        msgs = []
        while not queue.empty():
            msgs.append(queue.get())
        errors = {r: m for r, status, m in msgs if status == "error"}
        if errors and attempt + 1 < retries and any("address already in use" in m.lower() for m in errors.values()):
            continue
        if alive:
            raise TimeoutError(f"{len(alive)} of {world_size} ranks still running after {timeout}s")
        if errors:
            r = min(errors)
            raise RuntimeError(f"rank {r} failed: {errors[r]}")
        results = [None] * world_size
        for r, _status, m in msgs:
            results[r] = m
        return results
    raise RuntimeError("could not start a gloo world")


# ----------------------------------------------------------------------------- references
def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    layout: str = "sbhd",
    softmax_scale: Optional[float] = None,
    attention_mask: Optional[torch.Tensor] = None,
    attention_bias: Optional[torch.Tensor] = None,
    window_size=None,
    softmax_offset: Optional[torch.Tensor] = None,
    return_lse: bool = False,
):
    """float64 attention on the full sequence, by hand: softmax(q k^T * scale + bias) v.

    GQA: query head ``i`` uses kv head ``i // (hq / hk)``.  Masked (True) positions are
    excluded; a row with nothing allowed gives zeros.  ``window_size=(left, right)``: key ``j``
    allowed for query ``i`` iff ``i - left <= j <= i + right`` (-1 unbounded).
    ``softmax_offset [hq]``: an extra score column per head (value 0), the sink.  ``return_lse``:
    also the log-sum-exp of each row (sink included), ``[s, b, h]`` / ``[b, s, h]``."""
    to_bhsd = (lambda t: t.permute(1, 2, 0, 3)) if layout == "sbhd" else (lambda t: t.transpose(1, 2))
    qb, kb, vb = (to_bhsd(t).double() for t in (q, k, v))
    hq, hk = qb.shape[1], kb.shape[1]
    kb = kb.repeat_interleave(hq // hk, dim=1)
    vb = vb.repeat_interleave(hq // hk, dim=1)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(qb.shape[-1])
    scores = torch.einsum("bhqd,bhkd->bhqk", qb, kb) * scale
    if attention_bias is not None:
        scores = scores + attention_bias.double()
    S, Sk = scores.shape[-2:]
    allowed = torch.ones(S, Sk, dtype=torch.bool)
    if causal:
        allowed = allowed.tril()
    if window_size is not None:
        i, j = torch.arange(S)[:, None], torch.arange(Sk)[None, :]
        left, right = window_size
        if left >= 0:
            allowed = allowed & (j >= i - left)
        if right >= 0:
            allowed = allowed & (j <= i + right)
    allowed = allowed.expand_as(scores)
    if attention_mask is not None:
        allowed = allowed & ~attention_mask
    scores = scores.masked_fill(~allowed, float("-inf"))
    if softmax_offset is not None:
        sink = softmax_offset.double().view(1, hq, 1, 1).expand(*scores.shape[:3], 1)
        scores = torch.cat([scores, sink], dim=-1)
        vb = torch.cat([vb, vb.new_zeros(*vb.shape[:2], 1, vb.shape[-1])], dim=2)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # fully masked rows
    out = torch.einsum("bhqk,bhkd->bhqd", probs, vb)
    out = out.permute(2, 0, 1, 3) if layout == "sbhd" else out.transpose(1, 2)
    if return_lse:
        return out, (lse.permute(2, 0, 1) if layout == "sbhd" else lse.transpose(1, 2))
    return out


def run_in_session(cmd, *, env, cwd, timeout: float, signal_when=None):
    """Run ``cmd`` (e.g. torchrun) in its own session, output to files; the whole session is
    killed afterwards, so helpers a killed rank leaves behind (dist_checkpointing's writer
    queue manager) cannot linger.  ``signal_when=(text, signum)``: send ``signum`` to ``cmd``'s
    process (the launcher, not its children) once ``text`` appears in its stdout.  Returns
    ``(returncode, stdout, stderr)``."""
    import signal
    import subprocess
    import tempfile
    import time

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=err, env=env, cwd=str(cwd), start_new_session=True, preexec_fn=die_with_parent
        )
        try:
            deadline = time.time() + timeout
            while signal_when is not None and proc.poll() is None and time.time() < deadline:
                with open(f"/proc/self/fd/{out.fileno()}") as view:
                    if signal_when[0] in view.read():
                        proc.send_signal(signal_when[1])
                        break
                time.sleep(0.05)
            rc = proc.wait(timeout=max(1.0, deadline - time.time()))
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        out.seek(0)
        err.seek(0)
        return rc, out.read(), err.read()


# ----------------------------------------------------------------------------- instrumentation
class CollectiveCounter:
    """Counts torch.distributed collectives per thread (per rank of a threaded world) while
    installed: the tests' instrument, so product code carries none.  ``with count_collectives()
    as c: ...; c.get("all_to_all_single")`` -> this thread's calls."""

    NAMES = ("all_to_all_single", "all_gather", "all_gather_object", "all_reduce", "broadcast")

    def __init__(self):
        self.counts = {}
        self._lock = threading.Lock()
        self._saved = {}

    def _wrap(self, name, fn):
        def counted(*a, **kw):
            key = (threading.get_ident(), name)
            with self._lock:
                self.counts[key] = self.counts.get(key, 0) + 1
            return fn(*a, **kw)

        return counted

    def __enter__(self):
        for n in self.NAMES:
            self._saved[n] = getattr(dist, n)
            setattr(dist, n, self._wrap(n, self._saved[n]))
        return self

    def __exit__(self, *exc):
        for n, fn in self._saved.items():
            setattr(dist, n, fn)

    def get(self, name: str) -> int:
        """This thread's calls of ``name``."""
        return self.counts.get((threading.get_ident(), name), 0)

    def total(self, name: str) -> int:
        """Every thread's calls of ``name``."""
        return sum(n for (_, nm), n in self.counts.items() if nm == name)


def count_collectives() -> CollectiveCounter:
    return CollectiveCounter()


# ----------------------------------------------------------------------------- exchange references
def reference_seq_to_head(full: torch.Tensor, rank: int, plan, kind: str, layout: str = "sbhd"):
    """Heads of ``rank`` from the full-sequence tensor (``kind`` 'q' or 'kv'): what the exchange delivers."""
    lo, hi = plan.q_range(rank) if kind == "q" else plan.kv_range(rank)
    return full[:, :, lo:hi]


def shard_tokens(full: torch.Tensor, rank: int, ulysses: int, layout: str = "sbhd") -> torch.Tensor:
    """Contiguous token shard ``rank`` of ``degree`` of a full-sequence tensor."""
    from ulysses_mcore.exchange.heads import seq_dim

    return full.chunk(ulysses, dim=seq_dim(layout))[rank]


def torchrun(ranks: int) -> list:
    """``python -m torch.distributed.run`` for ``ranks`` processes on a free port (append the script)."""
    import sys

    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(ranks),
        "--master-port",
        str(free_port()),
    ]


def run_tool(script: str, *args: str, timeout: float = 300.0):
    """``python SCRIPT ARGS`` from the repository root, one thread, warnings off: a completed process."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run(
        [sys.executable, script, *args], cwd=root, env=env, capture_output=True, text=True, timeout=timeout
    )


def run_ranks(n, args, cwd, *, script, timeout=120):
    """``n`` ranks as separate processes (no launcher killing the others): each must exit by itself."""
    port = free_port()
    procs = []
    for r in range(n):
        env = dict(
            os.environ,
            RANK=str(r),
            LOCAL_RANK=str(r),
            WORLD_SIZE=str(n),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONWARNINGS="ignore",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, script, *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
                cwd=str(cwd),
            )
        )
    out = []
    t0 = time.time()
    for p in procs:
        try:
            o, e = p.communicate(timeout=max(1, timeout - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            tails = [q.communicate()[1][-1500:] for q in procs]  # where each rank was: its stderr's tail
            raise AssertionError(
                f"a rank did not exit within {timeout}s; "
                + "; ".join(f"rank {r}'s stderr ends: {t!r}" for r, t in enumerate(tails))
            ) from None
        out.append((p.returncode, o, e))
    return out


def te_stand_in(monkeypatch) -> list:
    """Transformer Engine needs CUDA: a stand-in ``transformer_engine.pytorch.DotProductAttention`` with
    TE's constructor and forward keywords (causal ``sbhd`` calls: SDPA, grouped heads expanded) and a
    buffer standing for TE's per-layer FP8 state; ``backend="te"`` reads as installed.  Returns the
    list each construction's keywords are appended to (an instance's ``calls``: its forwards')."""
    import sys
    import types

    from ulysses_mcore import options

    built = []

    class StandIn(torch.nn.Module):
        def __init__(self, **kw):
            super().__init__()
            built.append(kw)
            self.register_buffer("fp8_meta", torch.zeros(2))  # stands for TE's per-layer FP8 state
            self.calls = []

        def forward(self, q, k, v, **kw):
            self.calls.append(kw)
            assert kw["qkv_format"] == "sbhd" and kw["attn_mask_type"] == "causal"
            g = q.shape[2] // k.shape[2]
            out = torch.nn.functional.scaled_dot_product_attention(
                *(t.repeat_interleave(n, 2).permute(1, 2, 0, 3) for t, n in ((q, 1), (k, g), (v, g))), is_causal=True
            )
            return out.permute(2, 0, 1, 3).reshape(q.shape[0], q.shape[1], -1)

    te = types.ModuleType("transformer_engine")
    te.pytorch = types.ModuleType("transformer_engine.pytorch")
    te.pytorch.DotProductAttention = StandIn
    monkeypatch.setitem(sys.modules, "transformer_engine", te)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te.pytorch)
    monkeypatch.setattr(options, "is_installed", lambda name: True)
    return built
