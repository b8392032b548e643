#!/usr/bin/env python3
"""Side-by-side Ulysses attention benchmark: ulysses_mcore vs DeepSpeed vs all-gather vs the floor.

    python tools/bench_attention.py [--world 2] [--kernel trivial,sdpa] [--seq 1024,4096,16384,65536] \
        [--heads 8 --head-dim 64] [--repeats 5] [--out docs/perf]

One gloo world of ``--world`` processes; same shapes, same inner kernel for everyone;
forward+backward medians over interleaved repeats after a warm-up.

* ``ulysses_mcore``  -- this package (packed q/k/v: 2 all-to-alls forward, 2 backward;
  the input check runs on the first call of a signature only).
* ``deepspeed``      -- ``deepspeed.sequence.layer.DistributedAttention`` (one all-to-all
  per tensor: 4 forward, 4 backward).
* ``allgather``      -- all-gather K and V over the sequence, local queries (SDPA only);
  the backward all-reduces dK/dV (gloo has no reduce-scatter).
* ``floor``          -- the all-to-alls every Ulysses implementation must do
  (``(P-1)/P`` of the local Q, K, V and output, forward and backward), timed as bare
  ``all_to_all_single`` calls of exactly those sizes in the same run, plus the local
  kernel on ``s`` tokens and ``h/P`` heads (fwd+bwd) on one rank with no communication.

Writes ``bench_attention_P{world}.md`` (markdown table), ``.json`` and ``.png`` under --out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from ulysses_mcore.devtools.bench import Report, run_world  # noqa: E402


def trivial_kernel(q, k, v, *, causal=True, softmax_scale=None):
    return q + k + v


def sdpa_kernel(q, k, v, *, causal=True, softmax_scale=None):
    from ulysses_mcore.kernels.sdpa import sdpa_attention

    return sdpa_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, layout="sbhd")


KERNELS = {"trivial": trivial_kernel, "sdpa": sdpa_kernel}


class _GatherSeq(torch.autograd.Function):
    """All-gather along the sequence; backward all-reduces and keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        P = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(P)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        P, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return g.chunk(P, dim=0)[r].contiguous(), None


def allgather_attention(q, k, v, group):
    P, r = dist.get_world_size(group), dist.get_rank(group)
    kf, vf = _GatherSeq.apply(k, group), _GatherSeq.apply(v, group)
    s = q.shape[0]
    qpos = torch.arange(r * s, (r + 1) * s).unsqueeze(1)
    allowed = torch.arange(s * P).unsqueeze(0) <= qpos  # causal over global positions
    qb, kb, vb = q.permute(1, 2, 0, 3), kf.permute(1, 2, 0, 3), vf.permute(1, 2, 0, 3)
    out = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, attn_mask=allowed)
    return out.permute(2, 0, 1, 3)


def _timed(fn):
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _start(rank, world, port, args):
    """This rank's gloo world and DeepSpeed's distributed state (its shm op, a g++ build of minutes, off)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(max(1, args.threads))
    import warnings

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    shm = get_accelerator().create_op_builder("ShareMemCommBuilder")  # its all-reduce op: not used here,
    if shm is not None:  # and a g++ build of minutes
        deepspeed.ops.__compatible_ops__[shm.NAME] = False
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)


def _impl_call(impl, kernel, group, ds):
    """(q, k, v) -> out of one implementation under test."""
    import ulysses_mcore

    base = dict(group=group, causal=True, backend=kernel)
    if impl == "ulysses_mcore":
        return lambda q, k, v: ulysses_mcore.ulysses_attention(q, k, v, **base)
    if impl == "ulysses_nocheck":
        return lambda q, k, v: ulysses_mcore.ulysses_attention(q, k, v, **base, check=False)
    if impl.startswith("ulysses_c"):
        chunks = int(impl[len("ulysses_c") :])
        return lambda q, k, v: ulysses_mcore.ulysses_attention(q, k, v, **base, overlap_chunks=chunks)
    if impl == "deepspeed":
        return lambda q, k, v: ds(q, k, v, 1)
    return lambda q, k, v: allgather_attention(q, k, v, group)


def _tasks(kname, kernel, S, P, H, D, args, group, rank):
    """name -> one timed call: each implementation (fwd+bwd) and the floor's pieces (bare
    all-to-alls of exactly the exchanged sizes; the local kernel on rank 0); and the exchanged sizes."""
    from deepspeed.sequence.layer import DistributedAttention

    g = torch.Generator().manual_seed(S)
    q, k, v, dout = (torch.randn(S // P, 1, H, D, generator=g) for _ in range(4))
    ds = DistributedAttention(lambda a, b, c: kernel(a, b, c), group, scatter_idx=2, gather_idx=0)

    def run(call):
        qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
        call(qs, ks, vs).backward(dout)

    qkv_send = torch.randn(P, S // P, 1, 3 * H // P, D)
    out_send = torch.randn(P, S // P, 1, H // P, D)
    rq, ro = torch.empty_like(qkv_send), torch.empty_like(out_send)

    def bare_a2a():
        for _ in range(2):  # forward and backward
            dist.all_to_all_single(rq, qkv_send, group=group)
            dist.all_to_all_single(ro, out_send, group=group)

    gk = torch.Generator().manual_seed(1)
    kq, kk, kv, kd = (torch.randn(S, 1, H // P, D, generator=gk) for _ in range(4))

    def local_kernel():
        if rank == 0:
            a, b, c = (t.clone().requires_grad_() for t in (kq, kk, kv))
            kernel(a, b, c, causal=True).backward(kd)

    impls = ["ulysses_mcore", "ulysses_nocheck", "deepspeed"] + (["allgather"] if kname == "sdpa" else [])
    impls += [f"ulysses_c{c}" for c in (int(c) for c in args.chunks.split(",")) if c > 1 and (H // P) % c == 0]
    tasks = {i: (lambda call=_impl_call(i, kernel, group, ds): run(call)) for i in impls}
    tasks.update(a2a=bare_a2a, kernel=local_kernel)
    return tasks, 2 * (P - 1) / P * (qkv_send.numel() + out_send.numel()) * 4


def _medians(tasks, args):
    times = {name: [] for name in tasks}
    for _ in range(args.warmup):
        for fn in tasks.values():
            _timed(fn)
    for _ in range(args.repeats):
        for name, fn in tasks.items():
            times[name].append(_timed(fn))
    return {name: statistics.median(v) for name, v in times.items()}


def _row(kname, S, P, H, D, med, exchanged):
    row = {"kernel": kname, "seq": S, "world": P, "heads": H, "head_dim": D}
    row.update({f"{n}_ms": med[n] * 1e3 for n in ("ulysses_mcore", "ulysses_nocheck", "deepspeed", "a2a", "kernel")})
    row["allgather_ms"] = med.get("allgather", float("nan")) * 1e3
    row["floor_ms"] = (med["a2a"] + med["kernel"]) * 1e3
    row["bytes_exchanged_per_rank"] = exchanged
    row["a2a_bandwidth_GBps"] = exchanged / med["a2a"] / 1e9
    row["ulysses_bandwidth_GBps"] = exchanged / max(med["ulysses_mcore"] - med["kernel"], 1e-9) / 1e9
    row["overlap_ms"] = {
        1: row["ulysses_mcore_ms"],
        **{int(n[len("ulysses_c") :]): med[n] * 1e3 for n in med if n.startswith("ulysses_c")},
    }
    row["ulysses_over_deepspeed"] = row["ulysses_mcore_ms"] / row["deepspeed_ms"]
    row["ulysses_over_floor"] = row["ulysses_mcore_ms"] / row["floor_ms"]
    row["deepspeed_over_floor"] = row["deepspeed_ms"] / row["floor_ms"]
    return row


def _worker(rank, world, port, args, queue):
    _start(rank, world, port, args)
    group, H, D, P = dist.group.WORLD, args.heads, args.head_dim, world
    results = []
    for kname in args.kernel.split(","):
        kernel = KERNELS[kname]
        for S in (int(s) for s in (args.seq if kname == "trivial" else args.sdpa_seq).split(",")):
            tasks, exchanged = _tasks(kname, kernel, S, P, H, D, args, group, rank)
            row = _row(kname, S, P, H, D, _medians(tasks, args), exchanged)
            results.append(row)
            if rank == 0:
                print(
                    f"[{kname} S={S}] ulysses {row['ulysses_mcore_ms']:.1f} ms, deepspeed {row['deepspeed_ms']:.1f} ms, "
                    f"floor {row['floor_ms']:.1f} ms (a2a {row['a2a_ms']:.1f} + kernel {row['kernel_ms']:.1f}); "
                    f"ratio vs DS {row['ulysses_over_deepspeed']:.2f}, vs floor {row['ulysses_over_floor']:.2f}",
                    flush=True,
                )
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def _table(results, world, note, preface=""):
    lines = [
        f"{preface}Ulysses attention, gloo on CPU, P = {world}, fp32, {results[0]['heads']} heads of "
        f"{results[0]['head_dim']}, batch 1, causal; forward+backward, median ms. {note}",
        "",
        "| kernel | seq | ulysses_mcore | (no check) | DeepSpeed | all-gather | floor (a2a + kernel) | "
        "ulysses / DeepSpeed | ulysses / floor | DeepSpeed / floor | MB exchanged / rank | a2a GB/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ag = "-" if r["allgather_ms"] != r["allgather_ms"] else f"{r['allgather_ms']:.1f}"
        lines.append(
            f"| {r['kernel']} | {r['seq']} | {r['ulysses_mcore_ms']:.1f} | {r['ulysses_nocheck_ms']:.1f} | "
            f"{r['deepspeed_ms']:.1f} | {ag} | {r['floor_ms']:.1f} ({r['a2a_ms']:.1f} + {r['kernel_ms']:.1f}) | "
            f"**{r['ulysses_over_deepspeed']:.2f}** | **{r['ulysses_over_floor']:.2f}** | {r['deepspeed_over_floor']:.2f} | "
            f"{r['bytes_exchanged_per_rank'] / 1e6:.1f} | {r['a2a_bandwidth_GBps']:.2f} |"
        )
    return lines


def _overlap_table(results):
    chunk_keys = sorted({int(c) for r in results for c in r.get("overlap_ms", {})})
    if len(chunk_keys) <= 1:
        return []
    lines = [
        "",
        "Overlap (head chunks pipelined with async all-to-alls), fwd+bwd ms and gain vs 1 chunk:",
        "",
        "| kernel | seq | " + " | ".join(f"{c} chunk{'s' if c > 1 else ''}" for c in chunk_keys) + " |",
        "|---|---|" + "---|" * len(chunk_keys),
    ]
    for r in results:
        o = {int(k): v for k, v in r["overlap_ms"].items()}
        cells = [f"{o[c]:.1f} ({o[1] / o[c]:.2f}x)" if c in o else "-" for c in chunk_keys]
        lines.append(f"| {r['kernel']} | {r['seq']} | " + " | ".join(cells) + " |")
    return lines


def render(rec) -> str:
    """The tables of a record (``world``, ``note``, optional ``preface``, ``rows``)."""
    rows = rec["rows"]
    return "\n".join(_table(rows, rec["world"], rec["note"], rec.get("preface", "")) + _overlap_table(rows)) + "\n"


def plot(rec, path):
    import matplotlib.pyplot as plt

    results, world = rec["rows"], rec["world"]
    kernels = sorted({r["kernel"] for r in results})
    fig, axes = plt.subplots(1, len(kernels), figsize=(6 * len(kernels), 4), squeeze=False)
    series = [("ulysses_mcore_ms", "ulysses_mcore"), ("deepspeed_ms", "DeepSpeed"), ("allgather_ms", "all-gather")]
    for ax, kname in zip(axes[0], kernels):
        rows = [r for r in results if r["kernel"] == kname]
        S = [r["seq"] for r in rows]
        for key, label in series + [("floor_ms", "floor")]:
            vals = [r[key] for r in rows]
            if all(v == v for v in vals):
                ax.plot(S, vals, "o-" if key != "floor_ms" else "k--", label=label)
        ax.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="fwd+bwd ms")
        ax.set_title(f"{kname} kernel, P={world} (gloo, CPU)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--kernel", default="trivial,sdpa")
    p.add_argument("--seq", default="1024,4096,16384,32768,65536", help="sequence lengths, trivial kernel")
    p.add_argument("--sdpa-seq", default="1024,4096,8192,16384", help="sequence lengths, sdpa kernel")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--chunks", default="1,2,4", help="overlap chunk counts to measure")
    p.add_argument("--out", default="runs/bench", help="where the JSON / Markdown / PNG go (docs/perf for the docs)")
    a = p.parse_args(argv)
    if a.world > (os.cpu_count() or 1):
        print(
            f"note: {a.world} ranks on {os.cpu_count()} cores: oversubscribed, times include contention",
            file=sys.stderr,
        )
    note = f"{os.cpu_count()} CPU cores, {a.threads} torch thread(s) per rank, {a.repeats} repeats."
    report = Report(a.out, f"bench_attention_P{a.world}", render, plot, record={"world": a.world, "note": note})
    report.section("rows", run_world(a.world, _worker, a)[0])
    print(report.text)
    print(f"wrote {report.base}.md/.json/.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
