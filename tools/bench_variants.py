"""Attention variants under Ulysses: max error against float64 and peak memory per sequence length.

For each variant (plain causal, multi-latent attention, sliding window, off-by-one and learnable
sinks, the log-sum-exp output, a broadcast bias, and -- the only way to say "sliding window" before
this package had ``window_size`` -- the window as a full ``[s, s]`` boolean mask):

* error: a Ulysses world of 2 threads (real all-to-alls) at s = 1024, forward + backward, max
  relative error of out, dq, dk, dv (and lse, d sink) against float64 attention written out by hand;
* memory: one fresh process per (variant, s) running this rank's share of the work -- the kernel on
  the gathered sequence for its heads, forward + backward -- and reporting its peak resident set
  (VmHWM) above the inputs' baseline, so the numbers are the kernel's working memory.

    python tools/bench_variants.py                       # s up to 32768, ~7 minutes on 2 cores
    python tools/bench_variants.py --seqs 4096 16384 --json docs/perf/bench_variants.json --plot docs/perf/bench_variants.png
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ulysses_mcore.devtools.bench import Report, progress  # noqa: E402

HEADS, DIM, WINDOW = 4, 64, 512  # per rank after the all-to-all: 4 heads of 64 (MLA: v 32)
VARIANTS = {
    "causal (SDPA)": dict(),
    "MLA (qk 64, v 32)": dict(dv=32),
    "window (512, 0), tiled": dict(window=(WINDOW, 0)),
    "window as [s, s] mask": dict(window_mask=True),
    "sinks off-by-one": dict(sink="off-by-one"),
    "sinks learnable": dict(sink="learnable"),
    "return_lse": dict(lse=True),
    "bias [1, 1, 1, s]": dict(bias=True),
}


def _inputs(S, dv, seed=0, b=1, h=HEADS, d=DIM):
    import torch

    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(S, b, h, d, generator=g),
        torch.randn(S, b, h, d, generator=g),
        torch.randn(S, b, h, dv, generator=g),
    )


def _call_kwargs(opts, S, h):
    import torch

    kw = dict(causal=True)
    if opts.get("window"):
        kw["window_size"] = opts["window"]
    if opts.get("window_mask"):  # True = masked: outside the causal window of WINDOW
        i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
        kw["attention_mask"] = ((j < i - WINDOW) | (j > i))[None, None]
        kw["causal"] = False
    if opts.get("sink") == "off-by-one":
        kw["softmax_offset"] = torch.zeros(h)
    if opts.get("sink") == "learnable":
        kw["softmax_offset"] = torch.linspace(-1, 1, h).requires_grad_()
    if opts.get("lse"):
        kw["return_lse"] = True
    if opts.get("bias"):
        kw["attention_bias"] = torch.linspace(-1, 0, S)[None, None, None, :]
    return kw


def _loss(res):
    if isinstance(res, tuple):
        return res[0].sum() + res[1].sum()
    return res.sum()


def memory_child(name, S):
    """One process: this rank's kernel work at sequence length S; prints peak RSS above baseline."""
    import torch

    from ulysses_mcore.kernels.sdpa import sdpa_attention

    torch.set_num_threads(1)
    opts = VARIANTS[name]
    q, k, v = (t.requires_grad_() for t in _inputs(S, opts.get("dv", DIM)))
    kw = _call_kwargs(opts, S, HEADS)
    base = _hwm()
    t0 = time.perf_counter()
    _loss(sdpa_attention(q, k, v, **kw)).backward()
    print(json.dumps({"peak_mb": (_hwm() - base) / 2**20, "seconds": time.perf_counter() - t0}))


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def error_of(name, S=1024, P=2):
    """Max relative error of a Ulysses world of P threads against float64, forward + backward."""
    import torch
    import torch.distributed as dist

    import ulysses_mcore
    from tests.helpers import reference_attention, run_threaded

    opts = VARIANTS[name]
    h = HEADS * P
    q, k, v = _inputs(S, opts.get("dv", DIM), seed=1, b=1, h=h)
    kw = _call_kwargs(opts, S, h)
    off = kw.get("softmax_offset")

    def rank_fn(rank, world):
        qs, ks, vs = (t.chunk(world)[rank].clone().requires_grad_() for t in (q, k, v))
        kwr = dict(kw)
        if off is not None:
            kwr["softmax_offset"] = off.detach().clone().requires_grad_(off.requires_grad)
        res = ulysses_mcore.ulysses_attention(qs, ks, vs, group=dist.group.WORLD, **kwr)
        _loss(res).backward()
        out = res[0] if isinstance(res, tuple) else res
        lse = res[1].detach() if isinstance(res, tuple) else None
        og = kwr["softmax_offset"].grad if off is not None and off.requires_grad else None
        return out.detach(), qs.grad, ks.grad, vs.grad, lse, og

    res = run_threaded(P, rank_fn)
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    offr = off.detach().double().requires_grad_(off.requires_grad) if off is not None else None
    window = opts.get("window")
    ref = reference_attention(
        qr,
        kr,
        vr,
        causal=kw["causal"],
        attention_mask=kw.get("attention_mask"),
        attention_bias=kw.get("attention_bias"),
        window_size=window,
        softmax_offset=offr,
        return_lse=True,
    )
    (ref[0].sum() + (ref[1].sum() if opts.get("lse") else 0)).backward()
    rel = lambda a, b: ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()  # noqa: E731
    errs = [rel(torch.cat([r[i] for r in res]), w) for i, w in enumerate([ref[0], qr.grad, kr.grad, vr.grad])]
    if opts.get("lse"):
        errs.append(rel(torch.cat([r[4] for r in res]), ref[1]))
    if offr is not None and offr.requires_grad:
        errs.append(rel(sum(r[5] for r in res), offr.grad))
    return max(errs)


def _memory(name, S):
    """Peak working memory and time of one variant at ``S`` tokens, in a fresh process (None: skipped)."""
    if name == "window as [s, s] mask" and S > 16384:
        return None  # the [s, s] mask and its float scores: several GB, skipped
    out = subprocess.run(
        [sys.executable, __file__, "--child", name, str(S)],
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    if out.returncode:
        raise SystemExit(f"{name} at s={S} failed:\n{out.stderr[-2000:]}")
    mem = json.loads(out.stdout.strip().splitlines()[-1])
    print(
        f"[bench_variants] {name:>24} s={S:>6}: peak {mem['peak_mb']:8.1f} MB, {mem['seconds']:.2f} s fwd+bwd",
        flush=True,
    )
    return mem


def render(rec) -> str:
    """The table of a record (``heads_per_rank``, ``head_dim``, ``window``, ``rows``)."""
    rows = rec["rows"]
    seqs = [int(S) for S in rows[0]["memory"]] if rows else []
    lines = [
        "| variant | max rel error (s=1024, ulysses 2, fwd+bwd) | "
        + " | ".join(f"peak MB / s fwd+bwd at s={S}" for S in seqs)
        + " |",
        "|---|---|" + "---|" * len(seqs),
    ]
    for r in rows:
        m = r["memory"]
        cells = [
            "--" if m[str(S)] is None else f"{m[str(S)]['peak_mb']:.0f} / {m[str(S)]['seconds']:.1f}" for S in seqs
        ]
        lines.append(f"| {r['variant']} | {r['max_rel_err_s1024_u2']:.1e} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rec, path):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rec["rows"]:
        xs = [int(S) for S, m in r["memory"].items() if m is not None]
        ax.plot(xs, [r["memory"][str(S)]["peak_mb"] for S in xs], marker="o", label=r["variant"])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length (tokens on this rank after the all-to-all)")
    ax.set_ylabel("peak working memory, fwd + bwd (MB)")
    ax.set_title(f"Attention variants, {rec['heads_per_rank']} heads x {rec['head_dim']} per rank (CPU, fp32)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, nargs="+", default=[4096, 16384, 32768])
    ap.add_argument(
        "--json", default="runs/bench/bench_variants.json", help="the record (the table and plot beside it)"
    )
    ap.add_argument("--plot", default=None, help="also draw the plot here")
    ap.add_argument("--child", nargs=2, metavar=("VARIANT", "S"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        memory_child(a.child[0], int(a.child[1]))
        return
    out, stem = os.path.split(a.json.removesuffix(".json"))
    setup = {"heads_per_rank": HEADS, "head_dim": DIM, "window": WINDOW, "rows": []}
    report = Report(out, stem, render, plot, record=setup)
    for name in progress(VARIANTS, desc="bench_variants", unit="variant"):
        err = error_of(name)
        memory = {str(S): _memory(name, S) for S in a.seqs}
        report.section(
            "rows", report.record["rows"] + [{"variant": name, "max_rel_err_s1024_u2": err, "memory": memory}]
        )
        print(f"[bench_variants] {name:>24}: max rel error vs float64 (s=1024, ulysses 2) {err:.1e}", flush=True)
    print(report.text)
    if a.plot:
        plot(report.record, a.plot)


if __name__ == "__main__":
    main()
