#!/usr/bin/env python3
"""Whole-step peak memory per rank: forward, backward and optimizer step, with the chunked
loss and the tiled MLP off and on, at ulysses 1, 2, 4 (CPU, gloo).

    python tools/bench_step_memory.py [--degrees 1,2,4] [--seq 1024,4096] [--budget-gb 1.5] [--out docs/perf]   (default runs/bench)

How it measures, and why it is honest: every point is a fresh world of P processes.  Each rank
builds Megatron's GPTModel (Ulysses local spec, a vocabulary of 32768 and ffn = 4 x hidden so
that logits and MLP intermediates matter), DDP and Adam, runs one step (the optimizer's state
is allocated there), then resets the kernel's resident-set high-water mark
(``/proc/self/clear_refs`` = 5), runs a second step and reads ``VmHWM``: the most memory the
process held at any instant of a steady-state step, everything included (autograd graph,
logits, gradients, the optimizer's temporaries, gloo buffers).  glibc is told to serve every
allocation above 64 KiB by mmap and to give it back at once (``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``), so the resident set follows the live tensors instead of keeping
freed heap.  Reported: ``peak`` (VmHWM) and ``transient`` (VmHWM minus the resident set just
before the step: what the step adds on top of weights, gradients and optimizer state).  On a
GPU the same numbers are ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ulysses_mcore.devtools import bench  # noqa: E402
from ulysses_mcore.devtools.bench import Report, progress, run_world  # noqa: E402

MODEL = dict(num_layers=2, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=8, num_query_groups=4)
VOCAB = 32768
CHUNK = 512
FEATURES = {"off": (None, None), "loss": (CHUNK, None), "mlp": (None, CHUNK), "both": (CHUNK, CHUNK)}


def _status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _worker(rank, world, port, S, feature, recompute, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import gc
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    from ulysses_mcore.megatron.compat import cpu_compat

    cpu_compat.apply()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import ulysses_mcore
    from megatron.core import tensor_parallel
    from ulysses_mcore.megatron.trainer import training
    from ulysses_mcore.megatron.layer.batch import make_lm_batch, shard_batch
    from ulysses_mcore.megatron.layer.memory import enable_chunked_loss
    from ulysses_mcore.megatron.layer.specs import get_ulysses_layer_spec

    loss_chunk, mlp_chunk = FEATURES[feature]
    ulysses_mcore.initialize(ulysses=world, verbose=False)
    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}
    cfg = training.gpt_config(**MODEL, **extra)
    model = training.build_gpt(
        cfg, vocab_size=VOCAB, max_sequence_length=S, layer_spec=get_ulysses_layer_spec(mlp_chunk_tokens=mlp_chunk)
    )
    if loss_chunk:
        enable_chunked_loss(model.module, loss_chunk)
    opt = training.build_optimizer(model, lr=1e-4)
    text = torch.randint(0, VOCAB, (1, S + 1), generator=torch.Generator().manual_seed(S))
    mbs = [shard_batch(make_lm_batch(text))]
    training.train_step(model, opt, mbs, seq_length=S, micro_batch_size=1)  # allocates Adam's state
    gc.collect()
    dist.barrier()
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    t0 = time.perf_counter()
    m = training.train_step(model, opt, mbs, seq_length=S, micro_batch_size=1)
    dt = time.perf_counter() - t0
    peak = _status("VmHWM")
    queue.put({"rank": rank, "before": before, "peak": peak, "seconds": dt, "loss": m["loss"]})
    dist.barrier()
    dist.destroy_process_group()


def measure(P, S, feature, recompute):

    res = run_world(P, _worker, S, feature, recompute, what=f"a rank at ulysses {P}, seq {S}, {feature}")
    return {
        "degree": P,
        "seq": S,
        "feature": feature,
        "recompute": recompute,
        "peak": max(r["peak"] for r in res),
        "transient": max(r["peak"] - r["before"] for r in res),
        "before": max(r["before"] for r in res),
        "seconds": max(r["seconds"] for r in res),
        "loss": res[0]["loss"],
    }


def with_plan(rows, budget, degrees):
    """The plan's peak for every measured point (ulysses-mcore plan, its constants fitted to this
    benchmark) and its error; the longest sequence in ``budget`` per rank, from the plan."""
    from ulysses_mcore.planning.memory_model import estimate, longest_sequence

    def kw(feature, recompute):
        lc, mc = FEATURES[feature]
        return dict(
            vocab_size=VOCAB,
            loss_chunk_tokens=lc,
            mlp_chunk_tokens=mc,
            torch_adam=True,
            recompute="full" if recompute else None,
            **MODEL,
        )

    states = {}
    for r in rows:
        est = estimate(seq_length=r["seq"], ulysses=r["degree"], **kw(r["feature"], r["recompute"]))
        states[id(r)] = est["weights_bytes"] + est["grads_bytes"] + est["optimizer_bytes"]
        r["plan_transient"] = est["step_transient_bytes"]
    runtime = sorted(r["before"] - states[id(r)] for r in rows)[len(rows) // 2]  # interpreter, libraries
    for r in rows:
        r["plan_peak"] = runtime + states[id(r)] + r["plan_transient"]
        r["plan_error"] = r["plan_peak"] / r["peak"] - 1
    fits = {}
    for P in degrees:
        for feature, rc in [("off", False), ("both", False), ("both", True)]:
            name = f"ulysses {P}, {'both features' if feature == 'both' else 'no features'}" + (
                " + full recompute" if rc else ""
            )
            fits[name] = longest_sequence(budget, 2 * P, ulysses=P, runtime_bytes=runtime, **kw(feature, rc))
    return runtime, fits


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--degrees", default="1,2,4")
    p.add_argument("--seq", default="1024,4096")
    p.add_argument("--features", default="off,both", help="measured at every --seq (and both + full recompute)")
    p.add_argument("--single", default="loss,mlp", help="measured at the longest --seq only (each feature alone)")
    p.add_argument("--budget-gb", type=float, default=1.5)
    p.add_argument("--out", default="runs/bench", help="where the JSON / Markdown / PNG go (docs/perf for the docs)")
    p.add_argument("--from-json", default=None, help="re-render a previous run's JSON (no measuring)")
    return p.parse_args(argv)


def _points(a, degrees, seqs, features):
    """(degree, seq, feature, full recompute) of every measurement."""
    points = [(P, S, f, False) for P in degrees for f in features for S in seqs]
    points += [(P, S, "both", True) for P in degrees for S in seqs]  # + full recompute
    return points + [(P, seqs[-1], f, False) for P in degrees for f in a.single.split(",") if f]


def _row_line(r, o):
    """One table row; the ratios to the point without features where it was measured, else '-'."""
    name = r["feature"] + (" + recompute" if r["recompute"] else "")
    ratio = (lambda k: f"{r[k] / o[k]:.2f}") if o else (lambda k: "-")
    return (
        f"| {r['degree']} | {r['seq']} | {name} | {r['peak'] / 1e9:.3f} | {r['transient'] / 1e9:.3f} | "
        f"{ratio('transient')} | {r['seconds']:.2f} | {ratio('seconds')} | "
        f"{r['plan_peak'] / 1e9:.3f} | {100 * r['plan_error']:+.1f}% |"
    )


def render(rec) -> str:
    """The table of a record (``model``, ``vocab``, ``chunks``, ``runtime_bytes``, ``budget_gb``,
    ``rows``, ``longest_sequence``)."""
    head = (rec["model"], rec["vocab"], rec["chunks"]["loss"][0], rec["chunks"]["mlp"][1])
    lines = _markdown(rec["rows"], rec["runtime_bytes"], rec["longest_sequence"], rec["budget_gb"], head)
    return "\n".join(lines) + "\n"


def _markdown(rows, runtime, fits, budget_gb, head):
    model, vocab, loss_chunk, mlp_chunk = head
    lines = [
        f"GPTModel {model}, vocab {vocab}, fp32, batch 1, Adam, gloo on CPU; per-rank whole-step peak "
        "(VmHWM of a fresh process over one steady-state step) and transient (peak minus the resident set "
        f"before the step). loss: --loss-chunk-tokens {loss_chunk}; mlp: --mlp-chunk-tokens {mlp_chunk}.",
        "",
        "| ulysses | seq | features | peak (GB) | transient (GB) | transient vs off | step (s) | step vs off | "
        "plan peak (GB) | plan error |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    off = {(r["degree"], r["seq"]): r for r in rows if r["feature"] == "off" and not r["recompute"]}
    lines += [_row_line(r, off.get((r["degree"], r["seq"]))) for r in rows]
    worst = max(abs(r["plan_error"]) for r in rows)
    lines += [
        "",
        f"ulysses-mcore plan (constants fitted to these points, runtime {runtime / 1e9:.3f} GB: the interpreter "
        f"and libraries) predicts every measured peak within {100 * worst:.1f}%.",
        "",
        f"Longest sequence whose whole-step peak fits {budget_gb:g} GB per rank (ulysses-mcore plan):",
        "",
    ]
    return lines + [f"- {k}: {v}" for k, v in fits.items()]


STYLES = {"off": "o-", "loss": "s--", "mlp": "^--", "both": "D-"}


def _curves(rows, features):
    """(degree, label, style, [(seq, peak GB)]) of each feature measured at every length, and of full recompute."""
    for P in sorted({r["degree"] for r in rows}):
        for f, rc in [(f, False) for f in features] + [("both", True)]:
            rs = sorted(
                (r for r in rows if (r["degree"], r["feature"], r["recompute"]) == (P, f, rc)), key=lambda r: r["seq"]
            )
            yield (
                P,
                f"U{P} {f}{' +rc' if rc else ''}",
                ":" if rc else STYLES[f],
                [(r["seq"], r["peak"] / 1e9) for r in rs],
            )


def plot(rec, path):
    import matplotlib.pyplot as plt

    rows = rec["rows"]
    # the features measured at every length (the others: at the longest only, open markers)
    features = [f for f in rec["chunks"] if len({r["seq"] for r in rows if r["feature"] == f}) > 1]
    colors = dict(zip(sorted({r["degree"] for r in rows}), ["tab:blue", "tab:orange", "tab:green", "tab:red"]))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for P, label, style, points in _curves(rows, features):
        ax.plot([x for x, _ in points], [y for _, y in points], style, color=colors[P], label=label, alpha=0.9)
    for r in (r for r in rows if r["feature"] not in features and not r["recompute"]):
        ax.plot([r["seq"]], [r["peak"] / 1e9], STYLES[r["feature"]][0], color=colors[r["degree"]], mfc="none")
    ax.axhline(rec["budget_gb"], color="gray", lw=0.8)
    ax.set(xscale="log", xlabel="sequence length", ylabel="whole-step peak GB per rank")
    ax.set_title("whole-step peak memory per rank (open markers: one feature alone)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    a = _parse(argv)
    os.environ.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0", OMP_NUM_THREADS="1")
    degrees = [int(x) for x in a.degrees.split(",")]
    seqs = [int(x) for x in a.seq.split(",")]
    features = a.features.split(",")
    setup = dict(model=MODEL, vocab=VOCAB, chunks=FEATURES, budget_gb=a.budget_gb)
    if a.from_json:  # re-render a previous run (no measuring)
        setup["rows"] = bench.load(a.from_json.removesuffix(".json"))["rows"]
    report = Report(a.out, "bench_step_memory", render, plot, record=setup)
    points = [] if a.from_json else _points(a, degrees, seqs, features)
    for point in progress(points, desc="bench_step_memory", unit="step"):
        report.record.setdefault("rows", []).append(measure(*point))
        _section(report, degrees)
    _section(report, degrees)
    print(report.text)
    return 0


def _section(report, degrees) -> None:
    """The plan's fit over the rows so far, then the report rewritten."""
    rows = report.record["rows"]
    runtime, fits = with_plan(rows, report.record["budget_gb"] * 1e9, degrees)
    report.record.update(runtime_bytes=runtime, longest_sequence=fits)
    report.section("rows", rows)


if __name__ == "__main__":
    sys.exit(main())
