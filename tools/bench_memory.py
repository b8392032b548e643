#!/usr/bin/env python3
"""Per-rank memory of a GPTModel forward+backward against sequence length, at ulysses 1, 2, 4.

    python tools/bench_memory.py [--degrees 1,2,4,2x2] [--seq 1024,2048,4096,8192] [--out docs/perf]   (default runs/bench)

For each degree P (or ``UxC``: Ulysses U x ring cp C, P = U*C), a gloo world of P ranks (dp 1) builds Megatron's GPTModel from the Ulysses
local spec and runs one forward+backward on one sequence.  Measured per rank, exactly:

* activations: the bytes autograd saves for backward (unique storages seen by a
  ``saved_tensors_hooks`` pack hook, parameters excluded) -- what sequence sharding is
  supposed to divide by P;
* weights and gradients: parameter and DDP gradient-buffer bytes;

and compared with ``ulysses-mcore plan``'s estimate.  Reports the reduction factor per degree,
the longest sequence that fits ``--budget-gb`` per degree (from the plan, calibrated by
the measurement), a markdown table and a PNG plot.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ulysses_mcore.devtools.bench import Report, progress, run_world  # noqa: E402
from ulysses_mcore.planning.memory_model import longest_sequence  # noqa: E402

MODEL = dict(num_layers=4, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=8, num_query_groups=4)
VOCAB = 512


def _worker(rank, world, port, seqs, ring, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
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

    ulysses_mcore.initialize(ulysses=world // ring, cp=ring, verbose=False)
    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    cfg = training.gpt_config(**MODEL)
    model = training.build_gpt(cfg, vocab_size=VOCAB, max_sequence_length=max(seqs))
    w_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    g_bytes = sum(b.grad_data.numel() * b.grad_data.element_size() for b in model.buffers)
    rows = []
    for S in seqs:
        text = torch.randint(0, VOCAB, (1, S + 1), generator=torch.Generator().manual_seed(S))
        batch = shard_batch(make_lm_batch(text))
        seen = {}

        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

        def pack(t):  # parameters that linears save are weights, counted apart
            st = t.untyped_storage()
            if st.data_ptr() not in weights:
                seen[st.data_ptr()] = st.nbytes()
            return t

        model.zero_grad_buffer()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).sum()
        act = sum(seen.values())
        loss.backward()
        rows.append(
            {
                "seq": S,
                "degree": world,
                "ulysses": world // ring,
                "cp": ring,
                "activations_bytes": act,
                "weights_bytes": w_bytes,
                "grads_bytes": g_bytes,
            }
        )
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def _with_plan(rows):
    """Each row with the plan's activation bytes, its error and the reduction against one rank."""
    from ulysses_mcore.planning.memory_model import estimate

    base1 = {r["seq"]: r["activations_bytes"] for r in rows if r["degree"] == 1}
    for r in rows:
        est = estimate(seq_length=r["seq"], ulysses=r["ulysses"], cp=r["cp"], vocab_size=VOCAB, **MODEL)
        r["plan_activations_bytes"] = est["activations_bytes"] + est["loss_transient_bytes"]  # + the saved softmax
        r["plan_error"] = r["plan_activations_bytes"] / r["activations_bytes"] - 1
        if r["seq"] in base1:
            r["reduction"] = base1[r["seq"]] / r["activations_bytes"]
    return rows


def render(rec) -> str:
    """The table of a record (``model``, ``vocab``, ``budget_gb``, ``rows``, ``longest_sequence``)."""
    return (
        "\n".join(_markdown(rec["rows"], rec["longest_sequence"], rec["budget_gb"], rec["model"], rec["vocab"])) + "\n"
    )


def _markdown(rows, fits, budget_gb, model, vocab):
    lines = [
        f"GPTModel {model}, vocab {vocab}, fp32, batch 1, local spec + Ulysses SDPA, gloo on CPU; "
        "per-rank bytes saved for backward (exact, unique storages), weights "
        f"{rows[0]['weights_bytes'] / 1e6:.1f} MB + grads {rows[0]['grads_bytes'] / 1e6:.1f} MB per rank at every degree.",
        "",
        "| seq | ulysses x cp | activations / rank (MB) | reduction vs 1 rank | / (ulysses x cp) | plan (MB) | plan error |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["seq"], r["degree"], -r["ulysses"])):
        red = r.get("reduction")
        ratio = f"{red:.2f} | {red / r['degree']:.3f}" if red else "- | -"  # no 1-rank point at this length
        lines.append(
            f"| {r['seq']} | {r['ulysses']} x {r['cp']} | {r['activations_bytes'] / 1e6:.1f} | {ratio} | "
            f"{r['plan_activations_bytes'] / 1e6:.1f} | {100 * r['plan_error']:+.1f}% |"
        )
    return lines + [
        "",
        f"Longest sequence in {budget_gb} GB per rank (plan: weights + grads + Adam + activations): "
        + ", ".join(f"ulysses {P}: {s}" for P, s in fits.items()),
    ]


def plot(rec, path):
    import matplotlib.pyplot as plt

    rows = rec["rows"]
    splits = list(dict.fromkeys((r["ulysses"], r["cp"]) for r in rows))
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for U, C in splits:
        rs = sorted((r for r in rows if (r["ulysses"], r["cp"]) == (U, C)), key=lambda r: r["seq"])
        label = f"ulysses {U}" + (f" x cp {C}" if C > 1 else "")
        ax.plot(
            [r["seq"] for r in rs], [r["activations_bytes"] / 1e6 for r in rs], "o-" if C == 1 else "s--", label=label
        )
        ax.plot([r["seq"] for r in rs], [r["plan_activations_bytes"] / 1e6 for r in rs], "x:", color="gray")
    ax.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="activation MB per rank")
    ax.set_title("activation memory per rank (x: ulysses-mcore plan)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--degrees", default="1,2,4")
    p.add_argument("--seq", default="1024,2048,4096,8192")
    p.add_argument("--budget-gb", type=float, default=1.0, help="per-rank budget for the longest-sequence column")
    p.add_argument("--out", default="runs/bench", help="where the JSON / Markdown / PNG go (docs/perf for the docs)")
    a = p.parse_args(argv)
    splits = [tuple(int(v) for v in x.split("x")) if "x" in x else (int(x), 1) for x in a.degrees.split(",")]
    seqs = [int(x) for x in a.seq.split(",")]
    kw = dict(vocab_size=VOCAB, **MODEL)
    fits = {
        P: longest_sequence(a.budget_gb * 1e9, 2 * P, ulysses=P, **kw) for P in sorted({u for u, c in splits if c == 1})
    }
    setup = {"model": MODEL, "vocab": VOCAB, "budget_gb": a.budget_gb, "longest_sequence": fits}
    report = Report(a.out, "bench_memory", render, plot, record=dict(setup, rows=[]))
    rows = []
    for U, C in progress(splits, desc="bench_memory", unit="layout"):
        rows = _with_plan(rows + run_world(U * C, _worker, seqs, C, what=f"a rank at ulysses {U} x cp {C}")[0])
        report.section("rows", rows)
    print(report.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
