#!/usr/bin/env python3
"""Single-GPU parts of the benchmarks (NCCL cannot put several ranks on one GPU).

    python tools/bench_gpu.py --out DIR [--device cuda] [--quick]

* kernels: forward+backward of each installed inner kernel (sdpa, flash, te) through
  ``ulysses_attention`` with a group of one, bf16, causal, vs sequence length;
* layout copies: the pack / unpack copies of the exchange (``QkvRoute.pack_all`` and
  ``unpack_grad_all``) at P = 2, 4, 8 on one device, with their achieved GB/s;
* memory: peak ``torch.cuda.max_memory_allocated`` of a GPTModel forward+backward per
  sequence length (degree 1; divide the activation part by P for P ranks).
Writes ``gpu_bench.json`` and ``gpu_bench.md`` into --out after each section (a failing section
is recorded and the next one runs; exit 1 if any failed).  ``--device cpu --quick`` runs the same
code on the CPU at small sizes: the suite's smoke run (tests/test_tools_bench_gpu.py), so this
script cannot call a function that is gone.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from ulysses_mcore.devtools import bench  # noqa: E402


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
    from ulysses_mcore import options, ulysses_attention

    rows = []
    for name in ("sdpa", "flash", "te"):
        if options.backend_error(name) and not (dev.type == "cpu" and name == "sdpa"):
            rows.append({"kernel": name, "skipped": options.backend_error(name)})
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
    """The exchange's pack (q, k, v -> send buffer) and gradient unpack copies, on one device."""
    from ulysses_mcore.exchange import heads, routes

    rows = []
    for P in (2, 4, 8):
        plan = heads.HeadPlan(32, 8, P)
        q, k, v = (torch.randn(S // P, 1, h, 128, device=dev, dtype=dtype) for h in (32, 8, 8))
        route = routes.qkv_route(q, v, plan, 0, "sbhd")
        t_pack = timeit(lambda: route.pack_all(q, k, v), dev)
        buf = route.pack_all(q, k, v).clone()
        t_unpack = timeit(lambda: route.unpack_grad_all(buf, k.shape, v.shape), dev)
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


def world_of_one(dev, seed: int) -> None:
    """This process as a world of one (NCCL on CUDA, gloo and the CPU shims on the CPU) with the
    package's groups, on a free local port (an inherited MASTER_PORT may belong to another world);
    on CUDA, Megatron's model-parallel RNG seeded with ``seed``.  Nothing if already initialised."""
    import socket

    import torch.distributed as dist

    import ulysses_mcore

    if dist.is_initialized():
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    if dev.type == "cpu":
        from ulysses_mcore.megatron.compat import cpu_compat

        cpu_compat.apply()
    else:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=0, world_size=1)
    ulysses_mcore.initialize(verbose=False)
    if dev.type == "cuda":
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def bench_memory(dev, seqs, quick=False):
    """Peak memory of a GPTModel forward+backward per sequence length (degree 1)."""
    from ulysses_mcore.megatron.trainer import training
    from ulysses_mcore.megatron.layer.batch import make_lm_batch

    world_of_one(dev, seed=0)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    size = dict(num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=256)
    if not quick:
        size = dict(num_layers=4, hidden_size=2048, num_attention_heads=16, num_query_groups=4, ffn_hidden_size=8192)
    cfg = training.gpt_config(**size, bf16=dtype == torch.bfloat16, params_dtype=dtype)
    vocab = 1024 if quick else 32768
    model = training.build_gpt(cfg, vocab_size=vocab, max_sequence_length=max(seqs))
    rows = []
    for S in seqs:
        b = training.to_device(make_lm_batch(torch.randint(0, vocab, (1, S + 1))), training.training_device())
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
        model(b["tokens"], b["position_ids"], None, labels=b["labels"]).sum().backward()
        peak = torch.cuda.max_memory_allocated() if dev.type == "cuda" else 0
        rows.append({"seq": S, "peak_gb": peak / 1e9, "peak_above_resident_gb": (peak - base) / 1e9})
        model.zero_grad_buffer()
    return rows


def _table(title, header, rows, fmt):
    lines = ["", f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        lines.append("| " + (f"skipped: {r['skipped']}" if "skipped" in r else fmt(r)) + " |")
    return lines


TABLES = {  # section -> (title, header, row format)
    "kernels": (
        "kernels, fwd+bwd, causal, 32 q / 8 kv heads of 128",
        ["kernel", "seq", "ms", "TFLOP/s"],
        lambda r: f"{r['kernel']} | {r['seq']} | {r['ms']:.2f} | {r['tflops']:.1f}",
    ),
    "copies": (
        "exchange copies (one device)",
        ["P", "seq", "MB", "pack ms (GB/s)", "unpack ms (GB/s)"],
        lambda r: (
            f"{r['P']} | {r['seq']} | {r['bytes'] / 1e6:.0f} | {r['pack_ms']:.2f} ({r['pack_GBps']:.0f}) | "
            f"{r['unpack_ms']:.2f} ({r['unpack_GBps']:.0f})"
        ),
    ),
    "memory": (
        "GPTModel forward+backward peak memory",
        ["seq", "peak GB", "above resident GB"],
        lambda r: f"{r['seq']} | {r['peak_gb']:.2f} | {r['peak_above_resident_gb']:.2f}",
    ),
}


class Report(bench.Report):
    """The GPU check's report (this script's and ``gpu_model_check.py``'s): ``STEM.json`` / ``STEM.md``
    under ``out_dir`` with the device's name, a table per section, written as each finishes."""

    def __init__(self, out_dir, stem, title, tables, device):
        name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
        super().__init__(out_dir, stem, self._render, record={"device": name, "torch": torch.__version__})
        self.title, self.tables = title, tables

    def _render(self, rec) -> str:
        lines = [f"# {self.title} on {rec['device']} (torch {rec['torch']})"]
        for name, (title, header, fmt) in self.tables.items():
            if name in rec:
                lines += _table(title, header, rec[name], fmt)
        return "\n".join(lines) + "\n"

    def run(self, sections) -> int:
        """The sections in order; the exit status (1 if any failed)."""
        failed = self.run_sections(sections)
        print(self.text)
        return 1 if failed else 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="small sizes (the suite's CPU smoke run)")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    seqs = [256, 512] if a.quick else [4096, 16384, 65536]
    report = Report(a.out, "gpu_bench", "single-device benchmarks", TABLES, dev)
    return report.run(
        [
            ("kernels", lambda: bench_kernels(dev, seqs, dtype)),
            ("copies", lambda: bench_copies(dev, 2048 if a.quick else 131072, dtype)),
            ("memory", lambda: bench_memory(dev, [256, 512] if a.quick else [8192, 32768, 65536], a.quick)),
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
