"""Ulysses attention on a token-sharded sequence, checked against full attention.

    torchrun --nproc-per-node 4 examples/attention_demo.py [--seq-length 4096 --heads 16 --kv-heads 4]
    torchrun --nproc-per-node 4 examples/attention_demo.py --ring 2     # Ulysses 2 x ring 2

Each rank holds seq_length / world tokens; rank 0 prints the max relative error of the
output and of dq, dk, dv against float64 attention over the whole sequence, and the bytes
each rank sent through the all-to-alls.  gloo on CPU, NCCL when every rank has a GPU.
"""

import argparse
import math
import os
import time

import torch
import torch.distributed as dist


def _args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--no-causal", action="store_true")
    p.add_argument("--ring", type=int, default=1, help="ring size C: Ulysses world/C x ring C (dual-chunk order)")
    return p.parse_args()


def _start():
    """(device, nccl?) after init_process_group: NCCL when every local rank has a GPU, else gloo."""
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    return torch.device("cuda" if use_cuda else "cpu"), use_cuda


def _reference(full, causal, d):
    """float64 attention of the whole sequence and its input gradients (every rank computes it)."""
    hq, hk, S = full[0].shape[2], full[1].shape[2], full[0].shape[0]
    qf, kf, vf = (t.double().requires_grad_() for t in full[:3])
    rep = hq // hk
    scores = torch.einsum("sbhd,tbhd->bhst", qf, kf.repeat_interleave(rep, 2)) / math.sqrt(d)
    if causal:
        scores = scores.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
    ref = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), vf.repeat_interleave(rep, 2))
    ref.backward(full[3].double())
    return ref, qf.grad, kf.grad, vf.grad


def _bytes_sent(args, U, C, world, elem):
    """(all-to-all bytes per rank fwd+bwd, qkv and out bytes per direction, ring-shift bytes)."""
    from ulysses_mcore import heads

    S, b, hq, d = args.seq_length, args.batch, args.heads, args.head_dim
    plan = heads.HeadPlan(hq, args.kv_heads, U)
    qkv = (S // world) * b * sum(plan.chunk_heads(j) for j in range(U)) * d * elem
    out = (S // world) * b * hq * d * elem
    ring = (3 * C - 2) * 2 * (S // C) * b * max(plan.kv_count(j) for j in range(U)) * d * elem if C > 1 else 0
    return 2 * (qkv + out) * (U - 1) // U, qkv, out, ring


def main():
    args = _args()
    dev, use_cuda = _start()
    import ulysses_mcore
    from ulysses_mcore.kernels.ring import ring_segments

    rank, world = dist.get_rank(), dist.get_world_size()
    S, b, hq, hk, d, C = args.seq_length, args.batch, args.heads, args.kv_heads, args.head_dim, args.ring
    if world % C:
        raise SystemExit(f"--ring {C} must divide the world size {world}")
    U, order = world // C, "load_balanced" if C > 1 else "contiguous"
    if S % (2 * world if C > 1 else world):
        raise SystemExit(f"--seq-length {S} must be divisible by {2 * world if C > 1 else world}")
    group, ring = ulysses_mcore.new_sequence_groups(U, C)  # Ulysses: contiguous ranks; ring: stride U

    def shard(t):
        return torch.cat([t[s0 : s0 + n] for s0, n in ring_segments(rank, world, S, order)])

    g = torch.Generator().manual_seed(0)
    full = [torch.randn(S, b, h, d, generator=g) for h in (hq, hk, hk, hq)]
    q, k, v, dout = (shard(t).to(dev).requires_grad_(i < 3) for i, t in enumerate(full))
    causal = not args.no_causal
    t0 = time.perf_counter()
    out = ulysses_mcore.ulysses_attention(q, k, v, group=group, ring_group=ring, causal=causal, token_order=order)
    out.backward(dout)
    elapsed = time.perf_counter() - t0
    refs = _reference(full, causal, d)
    errs = [
        ((a.double().cpu() - shard(r)).abs().max() / shard(r).abs().max()).item()
        for a, r in zip((out, q.grad, k.grad, v.grad), refs)
    ]
    worst = torch.tensor(max(errs))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    sent, qkv_bytes, out_bytes, ring_bytes = _bytes_sent(args, U, C, world, torch.finfo(q.dtype).bits // 8)
    if rank == 0:
        print(
            f"ulysses {U} x ring {C}, seq {S}, batch {b}, heads {hq} q / {hk} kv, head dim {d}, "
            f"{'causal' if causal else 'full'}, backend {'nccl' if use_cuda else 'gloo'}"
        )
        print(f"max relative error vs float64 (out, dq, dk, dv, all ranks): {worst.item():.2e}")
        print(
            f"all-to-all bytes sent per rank, forward+backward: {sent / 1e6:.2f} MB "
            f"(qkv {qkv_bytes / 1e6:.2f} MB + out {out_bytes / 1e6:.2f} MB per direction)"
            + (f"; ring shifts {ring_bytes / 1e6:.2f} MB" if C > 1 else "")
        )
        print(f"forward+backward on rank 0: {elapsed * 1e3:.1f} ms")
    del group, ring  # no group may outlive the process group
    ulysses_mcore.release()
    dist.destroy_process_group()
    if worst.item() > 1e-4:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
