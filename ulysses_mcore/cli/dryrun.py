"""``ulysses-mcore dryrun``: the trainer's model at full size on fake CUDA, one rank of each kind,
without a GPU (:mod:`ulysses_mcore.megatron.trainer.dryrun`).

    ulysses-mcore dryrun --world-size 8 --ulysses-degree 8 --num-layers 32 --hidden-size 4096 \\
        --num-attention-heads 32 --group-query-attention --num-query-groups 8 --ffn-hidden-size 14336 \\
        --swiglu --normalization RMSNorm --untie-embeddings-and-output-weights --vocab-size 128256 \\
        --seq-length 131072 --max-position-embeddings 131072 --micro-batch-size 1 --global-batch-size 8 --bf16

Takes every ``pretrain`` flag.  Needs the CUDA build of torch (no GPU): on Python 3.12,
``pip install torch==2.13.0`` is one.  Exit 1 if a host read or a device mismatch was found.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

from ulysses_mcore.planning.step_time import PRESETS


def build_parser():
    from ulysses_mcore.megatron.trainer.parser import build_parser as pretrain_parser  # --help stays light

    p = pretrain_parser(__doc__)
    g = p.add_argument_group("dry run")
    g.add_argument("--world-size", type=int, required=True, help="the ranks of the cluster the layout is for")
    g.add_argument("--preset", choices=["h100", "h200"], default="h100", help="GPU of the step-time prediction")
    g.add_argument("--json", action="store_true", help="print the reports as JSON")
    p.set_defaults(fake_cuda=True)  # the GPU-only features are sized, not refused
    return p


def _line(r) -> str:
    p = r.plan
    kernels = ", ".join(f"{k} x{n}" for k, n in r.kernels_forward.items()) or "none"
    back = ", ".join(f"{k} x{n}" for k, n in r.kernels_backward.items()) or "none"
    return "\n".join(
        [
            f"{r.kind}: {r.seconds:.1f} s",
            f"  attention kernels: forward {kernels}; backward {back}",
            f"  memory GB (measured): parameters {r.params_gb:.2f}, gradients {r.grads_gb:.2f}, "
            f"optimizer {r.optimizer_gb:.2f}, activations {r.activations_gb:.2f} at the forward's peak, "
            f"{r.step_gb:.2f} at the backward's -> peak {r.peak_gb:.2f} of the whole step; host {r.host_gb:.2f}",
            f"  plan GB:   weights {p['weights_bytes']:.2f}, gradients {p['grads_bytes']:.2f}, optimizer "
            f"{p['optimizer_bytes']:.2f}, activations + loss {p['activations_bytes'] + p['loss_transient_bytes']:.2f}"
            f" -> peak {p['total_bytes']:.2f} ({100 * (p['total_bytes'] / r.peak_gb - 1):+.1f}%)",
            f"  forward TFLOP: attention {r.forward_tflop['attention']:.2f} (model {r.model_forward_tflop['attention']:.2f}), "
            f"total {r.forward_tflop['total']:.2f} (model {r.model_forward_tflop['total']:.2f})",
            f"  at the step's peak: {'; '.join(r.peak_holders) or 'nothing measured'}",
            f"  all-to-all sent per layer (forward): {r.all_to_all_gb_per_layer:.3f} GB; "
            f"predicted step on {r.preset}: {r.step_s:.2f} s; host reads 0, device mismatches 0",
        ]
    )


def _layout(args) -> str:
    kind = "dynamic ulysses up to" if args.dynamic_ulysses else "ulysses"
    return (
        f"tp {args.tensor_model_parallel_size} x {kind} {args.ulysses_degree} x cp {args.context_parallel_size} "
        f"x pp {args.pipeline_model_parallel_size}"
    )


def main(argv=None) -> int:
    # torch's fake CUDA and Megatron (seconds of start-up) only once the flags parse
    from ulysses_mcore.devtools import fakeworld as fw

    args = build_parser().parse_args(argv)
    why = fw.unavailable()
    if why:
        print(f"error: ulysses-mcore dryrun: {why}", file=sys.stderr)
        return 2
    # Megatron and the dry run's model code only once fake CUDA is known to work here
    from ulysses_mcore.megatron.trainer import dryrun
    from ulysses_mcore.megatron.trainer.arguments import padded_vocab
    from ulysses_mcore.megatron.trainer.parser import trainer_config

    args.vocab_size = padded_vocab(args)
    args = trainer_config(args)  # one frozen record from here on
    try:
        reports = dryrun.run(args, args.world_size, args.preset)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - a host read or a device mismatch is the finding; else re-raise
        found = fw.finding(e)
        if found is None:
            raise
        print(f"dry run: world {args.world_size}, {_layout(args)}: FAILED: {found}")
        return 1
    if args.json:
        print(json.dumps([asdict(r) for r in reports], indent=1))
    else:
        print("\n".join(_line(r) for r in reports))
    top = max(reports, key=lambda r: r.peak_gb)
    node = min(args.world_size, PRESETS[args.preset]["gpus_per_node"])
    print(
        f"dry run: world {args.world_size}, {_layout(args)}: peak {top.peak_gb:.1f} GB "
        f"(plan {top.plan['total_bytes']:.1f} GB), forward {top.forward_tflop['total']:.1f} TFLOP, "
        f"all-to-all {top.all_to_all_gb_per_layer * args.num_layers / args.pipeline_model_parallel_size:.2f} GB, "
        f"host memory {max(r.host_gb for r in reports) * node:.1f} GB a node, host reads 0, device mismatches 0; "
        + fits_line(top.peak_gb, args.preset)
    )
    return 0


def fits_line(peak_gb: float, preset: str, headroom: float = 0.08) -> str:
    """``fits <preset>: yes|no (peak P of C GB)``: the peak against the GPU's memory less the allocator's share."""
    capacity = PRESETS[preset]["memory_gb"]
    ok = peak_gb <= capacity * (1 - headroom)
    return f"fits {preset}: {'yes' if ok else 'no'} (peak {peak_gb:.1f} of {capacity:g} GB, {headroom:.0%} kept free)"
