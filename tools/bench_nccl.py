#!/usr/bin/env python3
"""All-to-all on one node's GPUs and Ulysses attention over it: the node check's communication part.

    torchrun --nproc-per-node 8 tools/bench_nccl.py --out DIR [--quick]

NCCL on GPUs (gloo on the CPU: the suite's smoke run).  Two tables in ``bench_nccl.json`` /
``bench_nccl.md``, written by rank 0 as each finishes:

* ``all_to_all``: ``all_to_all_single`` of B bytes a rank, the median of timed repeats after a
  warm-up: algorithm bandwidth B / t and bus bandwidth B (P-1)/P / t (nccl-tests' definitions), the
  number to set beside NVLink's datasheet;
* ``ulysses``: ``ulysses_attention`` forward + backward, causal, Llama-3-8B's heads (32 q / 8 kv of
  128) over all ranks, bf16, per sequence length, against its floor measured in the same run: the
  same kernel on one rank's heads of the whole sequence without communication, plus bare
  all-to-alls of exactly the bytes Ulysses must move (q, k, v and the output, forward and backward).
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

HEADS, GROUPS, DIM = 32, 8, 128  # Llama-3-8B's attention


def timed(fn, dev, reps):
    """Median seconds of ``reps`` calls after two warm-up calls, every rank in step."""
    times = []
    for i in range(reps + 2):
        dist.barrier()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def all_to_all_rows(dev, sizes, reps):
    P, rows = dist.get_world_size(), []
    for nbytes in sizes:
        x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev)
        y = torch.empty_like(x)
        t = timed(lambda: dist.all_to_all_single(y, x), dev, reps)
        rows.append(
            {"mb": nbytes / 2**20, "ms": t * 1e3, "algbw": nbytes / t / 1e9, "busbw": nbytes * (P - 1) / P / t / 1e9}
        )
    return rows


def _qkv(seq, P, dtype, dev, grad=True):
    s = seq // P
    q = torch.randn(s, 1, HEADS, DIM, dtype=dtype, device=dev, requires_grad=grad)
    k, v = (torch.randn(s, 1, GROUPS, DIM, dtype=dtype, device=dev, requires_grad=grad) for _ in range(2))
    return q, k, v


def ulysses_rows(dev, seqs, reps):
    from ulysses_mcore import ulysses_attention
    from ulysses_mcore.kernels.sdpa import sdpa_attention

    P, dtype = dist.get_world_size(), torch.bfloat16 if dev.type == "cuda" else torch.float32
    rows = []
    for seq in seqs:
        q, k, v = _qkv(seq, P, dtype, dev)

        def ulysses():
            ulysses_attention(q, k, v, group=dist.group.WORLD, causal=True).sum().backward()

        # the floor: one rank's heads of the whole sequence, no communication ...
        lq = torch.randn(seq, 1, HEADS // P, DIM, dtype=dtype, device=dev, requires_grad=True)
        lk, lv = (
            torch.randn(seq, 1, max(GROUPS // P, 1), DIM, dtype=dtype, device=dev, requires_grad=True) for _ in range(2)
        )

        def kernel():
            sdpa_attention(lq, lk, lv, causal=True, layout="sbhd").sum().backward()

        # ... and bare all-to-alls of what Ulysses moves: q, k, v and the output, forward and backward
        moved = 2 * (2 * q.numel() + k.numel() + v.numel()) * q.element_size()
        buf = torch.empty(moved // q.element_size(), dtype=dtype, device=dev)
        out = torch.empty_like(buf)
        t_u, t_k = timed(ulysses, dev, reps), timed(kernel, dev, reps)
        t_a = timed(lambda: dist.all_to_all_single(out, buf), dev, reps)
        rows.append({"seq": seq, "ulysses_ms": t_u * 1e3, "kernel_ms": t_k * 1e3, "a2a_ms": t_a * 1e3,
                     "vs_floor": (t_k + t_a) / t_u})  # fmt: skip
    return rows


TABLES = {
    "all_to_all": (
        "all_to_all_single, one node",
        ["MB a rank", "ms", "algbw GB/s", "busbw GB/s"],
        lambda r: f"{r['mb']:.2f} | {r['ms']:.3f} | {r['algbw']:.1f} | {r['busbw']:.1f}",
    ),
    "ulysses": (
        "ulysses_attention fwd+bwd (32 q / 8 kv heads of 128, causal) vs the floor (kernel alone + bare all-to-alls)",
        ["seq", "ulysses ms", "kernel ms", "all-to-alls ms", "floor / ulysses"],
        lambda r: (
            f"{r['seq']} | {r['ulysses_ms']:.2f} | {r['kernel_ms']:.2f} | {r['a2a_ms']:.2f} | {r['vs_floor']:.3f}"
        ),
    ),
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--quick", action="store_true", help="small sizes (the suite's CPU smoke run)")
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sizes = [2**14, 2**18] if a.quick else [2**20, 2**24, 2**26, 2**28]
    seqs = [64 * dist.get_world_size()] if a.quick else [s * 1024 for s in (16, 64, 128)]
    report = None
    if dist.get_rank() == 0:
        from tools.bench_gpu import Report

        report = Report(a.out, "bench_nccl", f"all-to-all and Ulysses on {dist.get_world_size()} ranks", TABLES, dev)
    failed = 0
    for name, fn in (("all_to_all", lambda: all_to_all_rows(dev, sizes, 3 if a.quick else 10)),
                     ("ulysses", lambda: ulysses_rows(dev, seqs, 2 if a.quick else 5))):  # fmt: skip
        try:
            rows = fn()
        except Exception as e:  # noqa: BLE001 - the table says it failed; the next runs
            rows, failed = [{"skipped": f"failed: {type(e).__name__}: {str(e)[:300]}"}], failed + 1
        if report:
            report.section(name, rows)
    if report:
        print(report.write())
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
