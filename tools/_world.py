"""One spawned gloo world for the benchmarks: a free port, one process per rank, results back."""

from __future__ import annotations

import socket


def run_world(world: int, worker, *args, what: str = "a benchmark rank"):
    """Run ``worker(rank, world, port, *args, queue)`` in ``world`` spawned processes and return
    what they put on ``queue``; exits with an error naming the ranks' exit codes if any fails
    (instead of waiting forever for a result that will not come)."""
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=worker, args=(r, world, port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit(f"error: {what} failed (exit codes per rank: {[p.exitcode for p in procs]})")
    out = []
    while not queue.empty():
        out.append(queue.get())
    return out
