#!/usr/bin/env python3
"""UlyssesAttention inside Megatron-Core's GPTModel on one device: the GPU check's model part.

    python tools/gpu_model_check.py --out DIR [--device cuda|cpu] [--quick]

A world of one process (NCCL on CUDA, gloo on the CPU), Ulysses degree 1 (one GPU: the module's
own cost, no exchange).  Sections, each written to ``gpu_model.json`` / ``gpu_model.md`` as it
finishes (a failing one is recorded and the next runs; exit 1 if any failed):

* ``losses``: the trainer's default model (fp32, TF32 off), 20 optimizer steps on fixed synthetic
  batches, the same weights for any device (``init_layout_independent``); on CUDA beside the CPU
  run of this same section (``docs/perf/gpu_model_cpu_losses.json``, made with ``--device cpu``);
* ``peak``: the device's dense matmul throughput (bf16 on CUDA): MFU's denominator;
* ``speed``: bf16, 12 steps (9 timed): Ulysses' local spec at degree 1 against the baseline -- the
  same SDPA call without Ulysses (target: >= 0.98x its tokens/s, the same peak) -- and Ulysses with
  the chunked loss; labelled extra rows: Megatron's unfused ``DotProductAttention`` (fp32 softmax),
  SDPA's cuDNN kernel, the TE specs where Transformer Engine is installed.  Each variant its own row
  (one that fails says so; the rest still run): tokens/s over the timed steps, peak memory, MFU from
  the analytic FLOPs (``ModelShape.work``) against the measured matmul peak and against the
  datasheet's, the kernel and the torch / CUDA versions (the FLOPs ``FlopCounterMode`` counts are
  kept beside them in the JSON);
* ``profile``: one step of the Ulysses model under ``torch.profiler`` and a GEMM recorder: fp32
  GEMMs, copy kernels and synchronisations, listed;
* ``lengths``: tokens/s and peak memory of the Ulysses model per sequence length, doubling until
  the device runs out of memory (or a minute has passed).

``--device cpu --quick``: the same code at small sizes (tests/test_tools_gpu_model_check.py), so
the GPU lease never meets a function that is gone; ``--device cpu --sections losses
--save-cpu-losses`` writes the CPU losses the GPU's are compared with.
"""

import argparse
import contextlib
import dataclasses
import gc
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
    from ulysses_mcore.megatron.trainer import training

    bf16 = dtype == torch.bfloat16
    cfg = training.gpt_config(**size, bf16=bf16, params_dtype=dtype)
    model = training.build_gpt(cfg, vocab_size=vocab, max_sequence_length=seq, layer_spec=spec)
    training.init_layout_independent(model, cfg, seed)
    return model, training.build_optimizer(model, lr=1e-3, bf16=bf16)


class PlainSdpaAttention(torch.nn.Module):
    """The baseline core attention: the same SDPA call as Ulysses' local route (``sdpa_plain``), without
    Ulysses (no exchange, no validation, no prepared-call cache).  ``cudnn``: SDPA held to its cuDNN
    kernel (a labelled extra row)."""

    cudnn = False

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, **kw):  # fmt: skip
        super().__init__()
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, **kw):
        from ulysses_mcore.kernels.sdpa import sdpa_plain

        from torch.nn.attention import SDPBackend, sdpa_kernel

        gqa = query.shape[2] != key.shape[2]
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION) if self.cudnn else contextlib.nullcontext():
            out = sdpa_plain(query, key, value, causal=True, softmax_scale=self.softmax_scale, gqa=gqa)
        return out.reshape(out.shape[0], out.shape[1], -1)


class CudnnSdpaAttention(PlainSdpaAttention):
    cudnn = True


def _with_core_attention(spec, core):
    """Megatron's local layer spec with ``core`` as its core attention."""
    sa = spec.submodules.self_attention
    sub = dataclasses.replace(sa.submodules, core_attention=core)
    return dataclasses.replace(
        spec, submodules=dataclasses.replace(spec.submodules, self_attention=dataclasses.replace(sa, submodules=sub))
    )


def spec_of(name):
    """Layer specs by name: Ulysses' (local / TE), the baseline (the same kernel without Ulysses) and
    Megatron's own (no Ulysses)."""
    from megatron.core.models.gpt import gpt_layer_specs as g

    from ulysses_mcore.megatron.layer.specs import get_ulysses_layer_spec

    return {
        "ulysses-sdpa": lambda: get_ulysses_layer_spec("local"),
        "baseline-sdpa": lambda: _with_core_attention(g.get_gpt_layer_local_spec(), PlainSdpaAttention),
        "baseline-cudnn": lambda: _with_core_attention(g.get_gpt_layer_local_spec(), CudnnSdpaAttention),
        "megatron-local": g.get_gpt_layer_local_spec,
        "ulysses-te": lambda: get_ulysses_layer_spec("te"),
        "megatron-te": g.get_gpt_layer_with_transformer_engine_spec,
    }[name.replace(" + chunked loss", "")]()


def batches(n, seq, vocab, seed=0):
    from ulysses_mcore.megatron.layer.batch import make_lm_batch

    gen = torch.Generator().manual_seed(seed)
    return [make_lm_batch(torch.randint(0, vocab, (1, seq + 1), generator=gen)) for _ in range(n)]


def steps(model, optimizer, data, seq, dev, warm=3):
    """Optimizer steps over ``data`` (one micro-batch each): (losses, seconds of the timed steps, how
    many were timed) -- the first ``warm`` (at most all but one) are not timed."""
    from ulysses_mcore.megatron.trainer import training

    losses, t0 = [], None
    first = min(warm, len(data) - 1)
    for i, b in enumerate(data):
        if i == first:
            sync(dev)
            t0 = time.perf_counter()
        losses.append(training.train_step(model, optimizer, [b], seq_length=seq, micro_batch_size=1)["loss"])
    sync(dev)
    return losses, time.perf_counter() - t0, len(data) - first


def tokens_per_s(seq: int, seconds: float, timed: int) -> float:
    """Tokens per second of ``timed`` steps of one ``seq``-token micro-batch that took ``seconds``."""
    return timed * seq / seconds


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def peak(dev):
    return torch.cuda.max_memory_allocated() / 1e9 if dev.type == "cuda" else 0.0


def fresh(dev):
    """Every earlier model gone before the next is built: the trainer's DDP and its config refer to each
    other (``config.no_sync_func = ddp.no_sync``), so only the cycle collector frees them."""
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def section_losses(dev, quick):
    """The default model in fp32 on this device, beside the CPU's losses."""
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    seq, vocab, n = 256, 512, 5 if quick else 20
    model, opt = build(TINY, torch.float32, spec_of("ulysses-sdpa"), seq, vocab)
    losses, _, _ = steps(model, opt, batches(n, seq, vocab), seq, dev)
    ref = json.load(open(CPU_LOSSES))["losses"] if os.path.exists(CPU_LOSSES) else None
    rows = []
    for i, loss in enumerate(losses):
        cpu = ref[i] if ref and i < len(ref) else None
        rows.append({"iteration": i + 1, "loss": loss, "cpu": cpu, "rel": abs(loss - cpu) / abs(cpu) if cpu else None})
    return rows


CHUNK_TOKENS = 2048  # the chunked loss's chunk (--loss-chunk-tokens)
EXTRA = {  # labelled extra rows: not the baseline, shown beside it
    "megatron-local": "extra: Megatron's unfused DotProductAttention (fp32 softmax), not Ulysses' cost",
    "baseline-cudnn": "extra: SDPA's cuDNN kernel without Ulysses",
    "megatron-te": "extra: Megatron's TEDotProductAttention",
}


def _variants(dev):
    """(variant names to run, (name, why skipped) pairs): Ulysses at degree 1 and the baseline, the
    chunked loss, the labelled extra rows where they run."""
    from ulysses_mcore import options

    names = ["baseline-sdpa", "ulysses-sdpa", "ulysses-sdpa + chunked loss"]
    skipped = []
    if dev.type == "cuda":
        names += ["megatron-local", "baseline-cudnn"]
    else:
        skipped += [(n, "needs CUDA") for n in ("megatron-local", "baseline-cudnn")]
    if options.backend_error("te"):
        skipped += [(n, "transformer-engine is not installed") for n in ("ulysses-te", "megatron-te")]
    else:
        names += ["ulysses-te", "megatron-te"]
    return names, skipped


DATASHEET_TFLOPS = {  # dense bf16 peak by the device name's model (NVIDIA's datasheets, SXM parts)
    "H200": 989,
    "H100": 989,
    "GH200": 989,
    "A100": 312,
    "B200": 2250,
}


def datasheet_tflops(device_name: str):
    """The datasheet's dense bf16 TFLOP/s of a device by its name, None where the table has no entry."""
    return next((v for k, v in DATASHEET_TFLOPS.items() if k in device_name.upper()), None)


def analytic_step_tflop(size, seq, vocab) -> float:
    """One training step of one ``seq``-token causal sequence (forward + backward = 3 forwards, no
    recompute), TFLOP, from the planners' per-layer work (:meth:`ModelShape.work`)."""
    from ulysses_mcore.planning.shape import ModelShape

    shape = ModelShape(vocab_size=vocab, **size)
    w = shape.work()
    per_layer = seq * (w["mlp"] + w["projections"]) + w["attention"] * seq * (seq + 1) / 2
    return 3 * (shape.num_layers * per_layer + w["logits"] * seq) / 1e12


def kernel_of(name: str) -> str:
    """The attention kernel a variant runs, with its version (every speed row carries it)."""
    import megatron.core

    if "-te" in name:
        import transformer_engine

        return f"transformer-engine {transformer_engine.__version__}"
    if name == "baseline-cudnn":
        return f"sdpa cuDNN {torch.backends.cudnn.version()}"
    if name == "megatron-local":
        return f"megatron-core {megatron.core.__version__} unfused"
    return f"torch sdpa {torch.__version__}"


def _measure(name, size, dtype, seq, vocab, data, dev):
    """One variant: tokens/s over the timed steps, peak memory, FLOPs of one step (counted)."""
    from ulysses_mcore.devtools.fakeworld import flop_counter

    fresh(dev)
    model, opt = build(size, dtype, spec_of(name), seq, vocab)
    if name.endswith("chunked loss"):
        from ulysses_mcore.megatron.layer.memory import enable_chunked_loss

        enable_chunked_loss(model.module, CHUNK_TOKENS)
    with flop_counter() as flops:
        steps(model, opt, data[:1], seq, dev)
    losses, secs, timed = steps(model, opt, data, seq, dev)
    row = {"variant": name, "tokens_per_s": tokens_per_s(seq, secs, timed), "peak_gb": peak(dev)}
    row.update(last_loss=losses[-1], step_tflop=flops.get_total_flops() / 1e12, step_s=secs / timed)
    if name in EXTRA:
        row["note"] = EXTRA[name]
    del model, opt
    return row


def _measure_or_say(name, size, dtype, seq, vocab, data, dev):
    """A variant's row; one that fails is a row saying how (the others still run: the table is kept)."""
    versions = {"kernel": kernel_of(name), "torch": torch.__version__, "cuda": torch.version.cuda or "-"}
    try:
        return dict(_measure(name, size, dtype, seq, vocab, data, dev), **versions)
    except Exception as e:  # noqa: BLE001 - the row says it failed; the next variant runs
        fresh(dev)
        return dict(
            {"variant": name, "skipped": f"{name}: failed: {type(e).__name__}: {str(e).strip()[:200]}"}, **versions
        )


def section_speed(dev, quick, bf16_tflops=None):
    """Ulysses at degree 1 against the same kernel without Ulysses (the baseline: target >= 0.98x its
    tokens/s, the same peak), with the chunked loss and the labelled extra rows, each variant its own
    row (a failing one says so); MFU from the analytic FLOPs against the matmul peak measured on this
    device and against the datasheet's."""
    size, seq, vocab, n = (TINY, 256, 512, 5) if quick else (SPEED, 8192, 32768, 12)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    names, skipped = _variants(dev)
    data = batches(n, seq, vocab)
    rows = [{"variant": name, "skipped": f"{name}: {why}"} for name, why in skipped]
    rows += [_measure_or_say(name, size, dtype, seq, vocab, data, dev) for name in names]
    sheet = datasheet_tflops(torch.cuda.get_device_name()) if dev.type == "cuda" else None
    peaks = {"mfu": bf16_tflops, "mfu_datasheet": sheet}
    return _against_baseline_and_peaks(rows, analytic_step_tflop(size, seq, vocab), peaks)


def _against_baseline_and_peaks(rows, analytic_tflop, peaks):
    """Each measured row's ratios to the baseline's row (None without one) and its MFU against each
    of ``peaks`` (name -> TFLOP/s, None where unknown)."""
    base = next((r for r in rows if r["variant"] == "baseline-sdpa" and "tokens_per_s" in r), None)
    for r in (r for r in rows if "tokens_per_s" in r):
        r["analytic_tflop"] = analytic_tflop
        r["vs_baseline"] = r["tokens_per_s"] / base["tokens_per_s"] if base else None
        r["memory_vs_baseline"] = r["peak_gb"] / base["peak_gb"] if base and base["peak_gb"] else None
        r.update({k: analytic_tflop / r["step_s"] / p if p else None for k, p in peaks.items()})
    return rows


def section_peak(dev, quick):
    """The device's dense matmul throughput (bf16 on CUDA, fp32 on the CPU): MFU's denominator."""
    n = 512 if quick else 8192
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    a, b = (torch.randn(n, n, device=dev, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    sync(dev)
    reps, t0 = 10 if quick else 50, time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(dev)
    secs = (time.perf_counter() - t0) / reps
    return [{"dtype": str(dtype).replace("torch.", ""), "n": n, "tflops": 2 * n**3 / secs / 1e12}]


def section_profile(dev, quick):
    """One step of the Ulysses model: fp32 GEMMs (dispatch recorder), copies and syncs (profiler)."""
    from torch.profiler import ProfilerActivity, profile

    from tests.test_gpu_ready import GemmRecorder

    size, seq, vocab = (TINY, 256, 512) if quick else (SPEED, 8192, 32768)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model, opt = build(size, dtype, spec_of("ulysses-sdpa"), seq, vocab)
    data = batches(3, seq, vocab)
    steps(model, opt, data[:2], seq, dev, warm=1)  # warm: the first call validates and prepares
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
            model, opt = build(size, dtype, spec_of("ulysses-sdpa"), seq, vocab)
            _, secs, timed = steps(model, opt, batches(4, seq, vocab), seq, dev, warm=2)
            rows.append({"seq": seq, "tokens_per_s": tokens_per_s(seq, secs, timed), "peak_gb": peak(dev)})
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
    "peak": (
        "dense matmul throughput of this device (MFU's denominator)",
        ["dtype", "n", "TFLOP/s"],
        lambda r: f"{r['dtype']} | {r['n']} | {r['tflops']:.1f}",
    ),
    "speed": (
        "Ulysses (degree 1) vs the same kernel without Ulysses (baseline-sdpa; target >= 0.98x, same peak)",
        "variant,tokens/s,peak GB,vs baseline,memory vs baseline,MFU (measured peak),MFU (datasheet),kernel,"
        "torch (cuda),note".split(","),
        lambda r: (
            f"{r['variant']} | {r['tokens_per_s']:.0f} | {r['peak_gb']:.2f} | {_or_dash(r['vs_baseline'])} | "
            f"{_or_dash(r.get('memory_vs_baseline'))} | {_or_dash(r.get('mfu'))} | "
            f"{_or_dash(r.get('mfu_datasheet'))} | {r['kernel']} | {r['torch']} ({r['cuda']}) | {r.get('note', '')}"
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
SECTIONS = {
    "losses": section_losses,
    "peak": section_peak,
    "speed": section_speed,
    "profile": section_profile,
    "lengths": section_lengths,
}


def _or_dash(x):
    return "-" if x is None else f"{x:.3f}"


def _section(name, dev, quick, report):
    """A section's function with what it needs of earlier sections (speed: the measured peak)."""
    if name == "speed":
        return lambda: section_speed(dev, quick, (report.record.get("peak") or [{}])[0].get("tflops"))
    return lambda: SECTIONS[name](dev, quick)


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
    status = report.run([(name, _section(name, dev, a.quick, report)) for name in a.sections.split(",")])
    losses = report.record.get("losses", [{}])
    if a.save_cpu_losses and dev.type == "cpu" and "loss" in losses[0]:
        with open(CPU_LOSSES, "w") as f:
            json.dump({"what": "tools/gpu_model_check.py --device cpu --sections losses", "torch": torch.__version__,
                       "losses": [r["loss"] for r in losses]}, f, indent=1)  # fmt: skip
    return status


if __name__ == "__main__":
    sys.exit(main())
