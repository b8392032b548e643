#!/usr/bin/env python3
"""UlyssesAttention inside Megatron-Core's GPTModel on one device: the GPU check's model part.

    python tools/gpu_model_check.py --out DIR [--device cuda|cpu] [--quick]

A world of one process (NCCL on CUDA, gloo on the CPU), Ulysses degree 1 (one GPU: the module's
own cost, no exchange).  Sections, each written to ``gpu_model.json`` / ``gpu_model.md`` as it
finishes (a failing one is recorded and the next runs; exit 1 if any failed):

* ``losses``: the trainer's default model (fp32, TF32 off), 20 optimizer steps on fixed synthetic
  batches, the same weights for any device (``init_layout_independent``); on CUDA beside the CPU
  run of this same section (``docs/perf/gpu_model_cpu_losses.json``, made with ``--device cpu``);
* ``speed``: bf16, 20 steps: Ulysses' local spec (sdpa) against Megatron's own local spec
  (``DotProductAttention``, no Ulysses), and the TE specs (Ulysses' TE child against Megatron's
  ``TEDotProductAttention``) where Transformer Engine is installed: tokens/s and peak memory;
* ``profile``: one step of the Ulysses model under ``torch.profiler`` and a GEMM recorder: fp32
  GEMMs, copy kernels and synchronisations, listed;
* ``lengths``: tokens/s and peak memory of the Ulysses model per sequence length, doubling until
  the device runs out of memory (or a minute has passed).

``--device cpu --quick``: the same code at small sizes (tests/test_tools_gpu_model_check.py), so
the GPU lease never meets a function that is gone; ``--device cpu --sections losses
--save-cpu-losses`` writes the CPU losses the GPU's are compared with.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from tools.bench_gpu import Report, world_of_one  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_LOSSES = os.path.join(ROOT, "docs", "perf", "gpu_model_cpu_losses.json")
TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=256)
SPEED = dict(num_layers=8, hidden_size=2048, num_attention_heads=16, num_query_groups=8, ffn_hidden_size=8192)


def build(size, dtype, spec, seq, vocab, seed=1234):
    """(DDP GPTModel, optimizer) of ``spec`` with weights drawn independently of the device."""
    from ulysses_mcore.megatron import training

    bf16 = dtype == torch.bfloat16
    cfg = training.gpt_config(**size, bf16=bf16, params_dtype=dtype)
    model = training.build_gpt(cfg, vocab_size=vocab, max_sequence_length=seq, layer_spec=spec)
    training.init_layout_independent(model, cfg, seed)
    return model, training.build_optimizer(model, lr=1e-3, bf16=bf16)


def spec_of(name):
    """Layer specs by name: Ulysses' (local / TE) and Megatron's own (no Ulysses)."""
    from megatron.core.models.gpt import gpt_layer_specs as g

    from ulysses_mcore.megatron.specs import get_ulysses_layer_spec

    return {
        "ulysses-local": lambda: get_ulysses_layer_spec("local"),
        "megatron-local": g.get_gpt_layer_local_spec,
        "ulysses-te": lambda: get_ulysses_layer_spec("te"),
        "megatron-te": g.get_gpt_layer_with_transformer_engine_spec,
    }[name]()


def batches(n, seq, vocab, seed=0):
    from ulysses_mcore.megatron.batch import make_lm_batch

    gen = torch.Generator().manual_seed(seed)
    return [make_lm_batch(torch.randint(0, vocab, (1, seq + 1), generator=gen)) for _ in range(n)]


def steps(model, optimizer, data, seq, dev):
    """Optimizer steps over ``data`` (one micro-batch each): (losses, seconds of the steps after the first 3)."""
    from ulysses_mcore.megatron import training

    losses, t0 = [], None
    for i, b in enumerate(data):
        if i == min(3, len(data) - 1):
            sync(dev)
            t0 = time.perf_counter()
        losses.append(training.train_step(model, optimizer, [b], seq_length=seq, micro_batch_size=1)["loss"])
    sync(dev)
    return losses, time.perf_counter() - t0


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def peak(dev):
    return torch.cuda.max_memory_allocated() / 1e9 if dev.type == "cuda" else 0.0


def fresh(dev):
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def section_losses(dev, quick):
    """The default model in fp32 on this device, beside the CPU's losses."""
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    seq, vocab, n = 256, 512, 5 if quick else 20
    model, opt = build(TINY, torch.float32, spec_of("ulysses-local"), seq, vocab)
    losses, _ = steps(model, opt, batches(n, seq, vocab), seq, dev)
    ref = json.load(open(CPU_LOSSES))["losses"] if os.path.exists(CPU_LOSSES) else None
    rows = []
    for i, loss in enumerate(losses):
        cpu = ref[i] if ref and i < len(ref) else None
        rows.append({"iteration": i + 1, "loss": loss, "cpu": cpu, "rel": abs(loss - cpu) / abs(cpu) if cpu else None})
    return rows


def _variants(dev):
    from ulysses_mcore import backends

    names = ["ulysses-local"] + (["megatron-local"] if dev.type == "cuda" else [])
    skipped = []
    if dev.type != "cuda":
        skipped.append(("megatron-local", "Megatron's DotProductAttention needs CUDA"))
    if backends.backend_error("te"):
        skipped += [(n, "transformer-engine is not installed") for n in ("ulysses-te", "megatron-te")]
    else:
        names += ["ulysses-te", "megatron-te"]
    return names, skipped


def section_speed(dev, quick):
    size, seq, vocab, n = (TINY, 256, 512, 5) if quick else (SPEED, 8192, 32768, 20)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    names, skipped = _variants(dev)
    data = batches(n, seq, vocab)
    rows = [{"variant": name, "skipped": why} for name, why in skipped]
    for name in names:
        fresh(dev)
        model, opt = build(size, dtype, spec_of(name), seq, vocab)
        losses, secs = steps(model, opt, data, seq, dev)
        timed = n - min(3, n - 1)
        rows.append(
            {"variant": name, "tokens_per_s": timed * seq / secs, "peak_gb": peak(dev), "last_loss": losses[-1]}
        )
        del model, opt
    base = {r["variant"].split("-")[1]: r for r in rows if r["variant"].startswith("megatron") and "tokens_per_s" in r}
    for r in rows:
        b = base.get(r["variant"].split("-")[1])
        if b and r["variant"].startswith("ulysses") and "tokens_per_s" in r:
            r["vs_megatron"] = r["tokens_per_s"] / b["tokens_per_s"]
            r["memory_vs_megatron"] = r["peak_gb"] / b["peak_gb"] if b["peak_gb"] else None
    return rows


def section_profile(dev, quick):
    """One step of the Ulysses model: fp32 GEMMs (dispatch recorder), copies and syncs (profiler)."""
    from torch.profiler import ProfilerActivity, profile

    from tests.test_gpu_ready import GemmRecorder

    size, seq, vocab = (TINY, 256, 512) if quick else (SPEED, 8192, 32768)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model, opt = build(size, dtype, spec_of("ulysses-local"), seq, vocab)
    data = batches(3, seq, vocab)
    steps(model, opt, data[:2], seq, dev)  # warm: the first call validates and prepares
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof, GemmRecorder() as rec:
        steps(model, opt, data[2:], seq, dev)
    events = prof.key_averages()
    wanted = ("Synchronize", "synchronize", "Memcpy DtoH", "cudaMemcpy", "copy_", "item", "_local_scalar_dense")
    rows = [
        {"event": e.key, "count": e.count, "ms": e.cpu_time_total / 1e3}
        for e in sorted(events, key=lambda e: -e.count)
        if any(w in e.key for w in wanted)
    ][:15]
    fp32 = [g for g in rec.gemms if g[1] == torch.float32]
    rows.insert(0, {"event": f"GEMMs: {len(rec.gemms)}, of them fp32: {len(fp32)}", "count": len(fp32), "ms": 0.0})
    return rows


def section_lengths(dev, quick):
    size, vocab = (TINY, 512) if quick else (SPEED, 32768)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    rows, seq, t0 = [], 256 if quick else 8192, time.perf_counter()
    while seq <= (512 if quick else 1 << 20) and time.perf_counter() - t0 < 60:  # 60 s for the section
        fresh(dev)
        try:
            model, opt = build(size, dtype, spec_of("ulysses-local"), seq, vocab)
            _, secs = steps(model, opt, batches(3, seq, vocab), seq, dev)
            rows.append({"seq": seq, "tokens_per_s": 2 * seq / secs, "peak_gb": peak(dev)})
            print(f"[gpu_model_check] length {seq}: {rows[-1]}", flush=True)
        except torch.OutOfMemoryError:
            rows.append({"seq": seq, "skipped": "out of memory: the longest that fits is the row above"})
            break
        finally:
            model = opt = None
        seq *= 2
    return rows


TABLES = {  # section -> (title, header, row format)
    "losses": (
        "losses, fp32, this device vs the CPU (same weights, same batches)",
        ["iteration", "loss", "CPU loss", "relative difference"],
        lambda r: (
            f"{r['iteration']} | {r['loss']:.6f} | {r['cpu'] or '-'} | "
            + ("-" if r["rel"] is None else f"{r['rel']:.1e}")
        ),
    ),
    "speed": (
        "Ulysses vs Megatron's own attention (degree 1, bf16 on CUDA)",
        ["variant", "tokens/s", "peak GB", "tokens/s vs Megatron", "memory vs Megatron"],
        lambda r: (
            f"{r['variant']} | {r['tokens_per_s']:.0f} | {r['peak_gb']:.2f} | {r.get('vs_megatron') or '-'} | "
            f"{r.get('memory_vs_megatron') or '-'}"
        ),
    ),
    "profile": (
        "one profiled step",
        ["event", "count", "ms"],
        lambda r: f"{r['event']} | {r['count']} | {r['ms']:.2f}",
    ),
    "lengths": (
        "tokens/s and peak memory per sequence length",
        ["seq", "tokens/s", "peak GB"],
        lambda r: f"{r['seq']} | {r['tokens_per_s']:.0f} | {r['peak_gb']:.2f}",
    ),
}
SECTIONS = {"losses": section_losses, "speed": section_speed, "profile": section_profile, "lengths": section_lengths}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="small sizes (the suite's CPU smoke run)")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of " + ",".join(SECTIONS))
    p.add_argument("--save-cpu-losses", action="store_true", help=f"write the losses section's losses to {CPU_LOSSES}")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    world_of_one(dev, seed=1234)
    report = Report(a.out, "gpu_model", "GPTModel with UlyssesAttention", TABLES, dev)
    status = report.run([(name, lambda name=name: SECTIONS[name](dev, a.quick)) for name in a.sections.split(",")])
    losses = report.res.get("losses", [{}])
    if a.save_cpu_losses and dev.type == "cpu" and "loss" in losses[0]:
        with open(CPU_LOSSES, "w") as f:
            json.dump({"what": "tools/gpu_model_check.py --device cpu --sections losses", "torch": torch.__version__,
                       "losses": [r["loss"] for r in losses]}, f, indent=1)  # fmt: skip
    return status


if __name__ == "__main__":
    sys.exit(main())
