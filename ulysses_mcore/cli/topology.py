"""Plan a Ulysses x TP x PP x DP x CP layout before launching a job.

    ulysses-mcore topology --world-size 64 --gpus-per-node 8 --tp 2 --ulysses 4 --pp 2 \
        [--num-attention-heads 32 --num-query-groups 8 --seq-length 131072] [--rank 5] [--json]

Prints the rank grid per node, every group of one rank, the per-rank head and token
split, and warns when a TP or Ulysses group crosses a node boundary.  Pure math: no GPU,
no torch.distributed.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..exchange.heads import HeadPlan
from ..topology import Topology, TopologyError

AXIS_SETS = ["tp", "ulysses", "cp", "ulysses-cp", "dp", "pp", "dp-ulysses-cp", "ep", "edp"]


def crossing_groups(topo: Topology, axes: str, gpus_per_node: int):
    return [g for g in topo.groups(axes) if len({r // gpus_per_node for r in g}) > 1]


def _heads(topo: Topology, args) -> dict:
    """Query / kv heads per tensor-parallel rank and inside attention (per Ulysses rank when uneven)."""
    q = args.num_attention_heads // topo.tp
    kv = (args.num_query_groups or args.num_attention_heads) // topo.tp
    hp = HeadPlan(q, kv, topo.ulysses)
    if hp.regular:
        qa, kva, rep = hp.q_count(0), hp.kv_count(0), hp.kv_replicas
    else:  # uneven: per-rank counts
        qa = [hp.q_count(r) for r in range(topo.ulysses)]
        kva = [hp.kv_count(r) for r in range(topo.ulysses)]
        rep = "shared at group boundaries"
    return {
        "query_heads_per_tp_rank": q,
        "kv_heads_per_tp_rank": kv,
        "query_heads_in_attention": qa,
        "kv_heads_in_attention": kva,
        "kv_replicas": rep,
    }


def _nodes(topo: Topology, gpus_per_node: int) -> list:
    """Each node's ranks with their coordinates."""
    keep = ("tp", "ulysses", "cp", "dp", "pp")
    return [
        [
            {"rank": r, **{k: v for k, v in topo.coords(r).items() if k in keep}}
            for r in range(n, min(n + gpus_per_node, topo.world_size))
        ]
        for n in range(0, topo.world_size, gpus_per_node)
    ]


def _warnings(topo: Topology, gpus_per_node: int) -> list:
    warnings = []
    for axes in ("tp", "ulysses"):
        bad = crossing_groups(topo, axes, gpus_per_node)
        if bad:
            warnings.append(
                f"{len(bad)} {axes} group(s) cross a node boundary (first: {bad[0]}); "
                f"keep tp x ulysses <= --gpus-per-node {gpus_per_node}"
            )
    return warnings


def plan(args) -> dict:
    topo = Topology(
        args.world_size, tp=args.tp, ulysses=args.ulysses, cp=args.cp, pp=args.pp, ep=args.ep, order=args.order
    )
    out = {"topology": topo.describe(), "dp": topo.dp, "order": topo.order}
    if args.num_attention_heads:
        topo.check_model(args.num_attention_heads, args.num_query_groups, args.seq_length)
        out["heads"] = _heads(topo, args)
    if args.seq_length:
        out["tokens"] = {
            "sequence": args.seq_length,
            "per_rank_outside_attention": args.seq_length // topo.context_parallel_size,
            "per_rank_inside_attention": args.seq_length // topo.cp,
        }
    out["rank"] = args.rank
    out["groups_of_rank"] = {
        a: topo.group_of(a, args.rank) for a in AXIS_SETS if (a not in ("ep", "edp") or topo.ep > 1)
    }
    out["coords_of_rank"] = topo.coords(args.rank)
    out["nodes"] = _nodes(topo, args.gpus_per_node)
    out["warnings"] = _warnings(topo, args.gpus_per_node)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, required=True, help="ranks in all")
    p.add_argument(
        "--gpus-per-node", type=int, default=8, help="ranks per node: what crosses a node (default: %(default)s)"
    )
    p.add_argument("--tp", "--tensor-model-parallel-size", dest="tp", type=int, default=1, help="tensor-parallel ranks")
    p.add_argument("--ulysses", "--ulysses-degree", dest="ulysses", type=int, default=1, help="Ulysses degree")
    p.add_argument(
        "--cp", "--context-parallel-size", dest="cp", type=int, default=1, help="ring context-parallel ranks"
    )
    p.add_argument("--pp", "--pipeline-model-parallel-size", dest="pp", type=int, default=1, help="pipeline stages")
    p.add_argument("--ep", "--expert-model-parallel-size", dest="ep", type=int, default=1, help="expert-parallel ranks")
    p.add_argument(
        "--order",
        default="tp-ulysses-cp-ep-dp-pp",
        help="axes from fastest-varying rank to slowest (default: %(default)s)",
    )
    p.add_argument(
        "--num-attention-heads", type=int, help="query heads: check they fit the degrees, print heads per rank"
    )
    p.add_argument("--num-query-groups", type=int, help="key/value heads (grouped-query attention)")
    p.add_argument("--seq-length", type=int, help="tokens per sample: check it splits, print tokens per rank")
    p.add_argument("--rank", type=int, default=0, help="whose groups to print")
    p.add_argument("--json", action="store_true", help="print everything as JSON")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        out = plan(args)
    except TopologyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(out["topology"])
    if "heads" in out:
        h = out["heads"]
        print(
            f"heads per tp rank: {h['query_heads_per_tp_rank']} q / {h['kv_heads_per_tp_rank']} kv; "
            f"inside attention each rank computes {h['query_heads_in_attention']} q / "
            f"{h['kv_heads_in_attention']} kv heads (kv replicated x{h['kv_replicas']})"
        )
    if "tokens" in out:
        t = out["tokens"]
        print(
            f"tokens: {t['sequence']} per sequence; {t['per_rank_outside_attention']} per rank outside "
            f"attention, {t['per_rank_inside_attention']} inside (all of them unless ring cp > 1)"
        )
    print(f"\ngroups of rank {out['rank']} (coords {out['coords_of_rank']}):")
    for a, g in out["groups_of_rank"].items():
        print(f"  {a:>14}: {g}")
    print("\nrank grid (rank:tp/ulysses/cp/dp/pp):")
    for i, node in enumerate(out["nodes"]):
        cells = " ".join(f"{c['rank']}:{c['tp']}/{c['ulysses']}/{c['cp']}/{c['dp']}/{c['pp']}" for c in node)
        print(f"  node {i}: {cells}")
    for w in out["warnings"]:
        print(f"WARNING: {w}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
