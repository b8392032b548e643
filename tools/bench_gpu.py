#!/usr/bin/env python3
"""Single-GPU parts of the benchmarks (NCCL cannot put several ranks on one GPU).

    python tools/bench_gpu.py --out DIR [--device cuda] [--quick]

* kernels: forward+backward of each installed inner kernel (sdpa, flash, te) through
  ``ulysses_attention`` with a group of one, bf16, causal, vs sequence length;
* layout copies: the pack / unpack copies of the exchange (``exchange._pack_qkv`` and the
  gradient unpack) at P = 2, 4, 8 on one device, with their achieved GB/s;
* memory: peak ``torch.cuda.max_memory_allocated`` of a GPTModel forward+backward per
  sequence length (degree 1; divide the activation part by P for P ranks).
Writes ``gpu_bench.json`` and ``gpu_bench.md`` into --out.  ``--device cpu`` runs the same
code on the CPU (to check the script; numbers are not GPU numbers).
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timeit(fn, dev, reps=5):
    fn()
    sync(dev)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(dev)
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def bench_kernels(dev, seqs, dtype):
    from ulysses_mcore import backends, ulysses_attention

    rows = []
    for name in ("sdpa", "flash", "te"):
        if backends.backend_error(name) and not (dev.type == "cpu" and name == "sdpa"):
            rows.append({"kernel": name, "skipped": backends.backend_error(name)})
            continue
        for S in seqs:
            q, k, v, g = (torch.randn(S, 1, h, 128, device=dev, dtype=dtype) for h in (32, 8, 8, 32))

            def step():
                a, b, c = (t.detach().requires_grad_() for t in (q, k, v))
                ulysses_attention(a, b, c, group=None, causal=True, backend=name).backward(g)

            t = timeit(step, dev)
            flops = 3.5 * 2 * 2 * S * S * 128 * 32 / 2  # causal fwd (2 matmuls) + bwd (2.5x)
            rows.append({"kernel": name, "seq": S, "ms": t * 1e3, "tflops": flops / t / 1e12})
    return rows


def bench_copies(dev, S, dtype):
    from ulysses_mcore import exchange

    rows = []
    for P in (2, 4, 8):
        plan = exchange.HeadPlan(32, 8, P)
        q, k, v = (torch.randn(S // P, 1, h, 128, device=dev, dtype=dtype) for h in (32, 8, 8))
        t_pack = timeit(lambda: exchange._pack_qkv(q, k, v, plan), dev)
        buf = exchange._pack_qkv(q, k, v, plan)[0].clone()
        t_unpack = timeit(lambda: exchange._unpack_qkv_grad(buf, plan, S // P, 1, 128, 128, k.shape, v.shape), dev)
        nbytes = buf.numel() * buf.element_size()
        rows.append(
            {
                "P": P,
                "seq": S,
                "bytes": nbytes,
                "pack_ms": t_pack * 1e3,
                "unpack_ms": t_unpack * 1e3,
                "pack_GBps": 2 * nbytes / t_pack / 1e9,
                "unpack_GBps": 2 * nbytes / t_unpack / 1e9,
            }
        )
    return rows


def bench_memory(dev, seqs):
    if dev.type != "cuda":
        return [{"skipped": "needs CUDA for max_memory_allocated"}]
    import torch.distributed as dist

    import ulysses_mcore
    from megatron.core import tensor_parallel
    from ulysses_mcore.megatron import training
    from ulysses_mcore.megatron.batch import make_lm_batch

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29611")
        dist.init_process_group("nccl", rank=0, world_size=1)
    ulysses_mcore.initialize(verbose=False)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    cfg = training.gpt_config(
        num_layers=4,
        hidden_size=2048,
        num_attention_heads=16,
        num_query_groups=4,
        ffn_hidden_size=8192,
        bf16=True,
        params_dtype=torch.bfloat16,
    )
    model = training.build_gpt(cfg, vocab_size=32768, max_sequence_length=max(seqs)).cuda()
    rows = []
    for S in seqs:
        b = {k: v.cuda() for k, v in make_lm_batch(torch.randint(0, 32768, (1, S + 1))).items()}
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model(b["tokens"], b["position_ids"], None, labels=b["labels"]).sum().backward()
        rows.append(
            {
                "seq": S,
                "peak_gb": torch.cuda.max_memory_allocated() / 1e9,
                "peak_above_resident_gb": (torch.cuda.max_memory_allocated() - base) / 1e9,
            }
        )
        model.zero_grad_buffer()
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    seqs = [1024, 2048] if a.quick else [4096, 16384, 65536]
    os.makedirs(a.out, exist_ok=True)
    res = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__}
    res["kernels"] = bench_kernels(dev, seqs, dtype)
    res["copies"] = bench_copies(dev, 8192 if a.quick else 131072, dtype)
    res["memory"] = bench_memory(dev, [2048, 4096] if a.quick else [8192, 32768, 65536])
    with open(os.path.join(a.out, "gpu_bench.json"), "w") as f:
        json.dump(res, f, indent=1)
    lines = [
        f"# single-device benchmarks on {res['device']} (torch {res['torch']})",
        "",
        "| kernel | seq | ms fwd+bwd | TFLOP/s |",
        "|---|---|---|---|",
    ]
    for r in res["kernels"]:
        lines.append(
            f"| {r['kernel']} | - | skipped: {r['skipped']} | |"
            if "skipped" in r
            else f"| {r['kernel']} | {r['seq']} | {r['ms']:.2f} | {r['tflops']:.1f} |"
        )
    lines += ["", "| P | seq | MB | pack ms (GB/s) | unpack ms (GB/s) |", "|---|---|---|---|---|"]
    for r in res["copies"]:
        lines.append(
            f"| {r['P']} | {r['seq']} | {r['bytes'] / 1e6:.0f} | {r['pack_ms']:.2f} ({r['pack_GBps']:.0f}) | "
            f"{r['unpack_ms']:.2f} ({r['unpack_GBps']:.0f}) |"
        )
    lines += ["", "| seq | peak GB | above resident GB |", "|---|---|---|"]
    for r in res["memory"]:
        lines.append(
            f"| - | skipped: {r['skipped']} | |"
            if "skipped" in r
            else f"| {r['seq']} | {r['peak_gb']:.2f} | {r['peak_above_resident_gb']:.2f} |"
        )
    with open(os.path.join(a.out, "gpu_bench.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
