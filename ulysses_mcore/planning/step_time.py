"""The layouts a world can run, and a step-time model of each (``ulysses-mcore sweep / fit / predict``).

**Layouts.**  :func:`enumerate_layouts` walks every ``tp x ulysses x cp x pp x dp`` of a world
and keeps the ones the trainer itself accepts (``ulysses_mcore.megatron.trainer.arguments.validate``:
``Topology``, the head limits, the sequence split, the batch split) and whose step peak fits the
memory budget (:mod:`ulysses_mcore.planning.memory_model`); every dropped layout comes back with its reason.

**Step time.**  A step of a layout is modelled phase by phase, each phase a count the layout
implies times a rate (:func:`features`; the FLOPs from :meth:`ModelShape.work`, the bytes from the
memory model: counted once for every reader, the dynamic placement's costs included), the rates
calibrated on measured steps (:func:`fit`) over several lengths, which is what separates a fixed
cost from a per-token one and a per-token one from a per-pair one:

* attention kernel: ``a x`` its FLOPs per rank (``4 h`` per causal (query, key) pair a layer, x3
  for the backward, the heads split over ``tp x ulysses``, the queries over ``cp``), plus a cost per
  query row (softmax, tiles) and per layer call;
* MLP: ``b x`` its FLOPs per rank, per layer call, and the tensor-parallel all-reduces inside it;
* Ulysses all-to-alls and ring shifts: ``alpha x`` messages ``+ bytes / bandwidth`` per link
  class (intra-node vs inter-node: which groups cross nodes follows from the rank order and the
  GPUs per node);
* optimizer: ``o x`` parameters per rank;
* the rest: a fixed cost a step and a micro-batch, the other matrix multiplies (QKV, projection,
  logits), a per-token cost that is no matmul (norms, activations, copies), host work per layer and
  micro-batch (launches, Python), tensor-parallel all-reduces outside the MLP, the data-parallel
  gradient reduction (over ``dp x ulysses x cp``), pipeline sends, and the pipeline bubble,
  ``(pp - 1) / micro-batches`` of a stage's work.

Nothing overlaps in the model (this project's trainer overlaps nothing: DDP's overlap is off,
the ring's shifts are waited on before the next block on CPU/gloo).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Tuple, Union

import numpy as np

from ..topology import Topology
from .memory_model import estimate
from .shape import ModelShape, model_named


@dataclass
class Run:
    """What a sweep runs: the model (a preset's name or a :class:`ModelShape`), the sequence, the batch."""

    model: Union[str, ModelShape] = "tiny"
    seq_length: int = 512
    micro_batch_size: int = 1
    global_batch_size: int = 4
    bf16: bool = False
    recompute: Optional[str] = None  # "full": Megatron's full activation recompute
    distributed_optimizer: bool = False

    SETTINGS = ("model", "seq_length", "micro_batch_size", "global_batch_size")

    def settings(self) -> Dict:
        """What a sweep record says of its run (a preset's name as the model)."""
        if not isinstance(self.model, str):
            raise ValueError("a sweep runs a preset model (--model): its record names it")
        return {k: getattr(self, k) for k in self.SETTINGS}

    @classmethod
    def from_settings(cls, settings: Dict) -> Run:
        return cls(**{k: settings[k] for k in cls.SETTINGS})

    @property
    def shape(self) -> ModelShape:
        return self.model if isinstance(self.model, ModelShape) else model_named(self.model)

    def trainer_flags(self) -> List[str]:
        flags = self.shape.flags() + [
            "--seq-length",
            self.seq_length,
            "--max-position-embeddings",
            self.seq_length,
            "--micro-batch-size",
            self.micro_batch_size,
            "--global-batch-size",
            self.global_batch_size,
        ]
        flags += ["--bf16"] if self.bf16 else []
        flags += ["--recompute-granularity", self.recompute] if self.recompute else []
        flags += ["--use-distributed-optimizer"] if self.distributed_optimizer else []
        return [str(f) for f in flags]


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(
    world: int, run: Run, budget_gb: Optional[float] = None, *, accepts: Optional[Callable] = None
) -> Tuple[List[Topology], Dict]:
    """(the layouts ``accepts`` takes and the budget holds, {dropped layout name: reason}).
    ``accepts(flags, world)``: the trainer's verdict on a layout's flags ("" or why not; the CLI
    passes :func:`ulysses_mcore.megatron.trainer.arguments.layout_problem`); without it every layout that
    divides the world is considered."""
    keep, dropped = [], {}
    for tp, ulysses, cp, pp in itertools.product(*[_divisors(world)] * 4):
        if world % (tp * ulysses * cp * pp):
            continue
        lay = Topology.of(tp, ulysses, cp, pp, world // (tp * ulysses * cp * pp))
        problem = accepts(run.trainer_flags() + lay.flags(), world) if accepts is not None else ""
        if problem:
            dropped[lay.name] = problem
            continue
        if budget_gb is not None:
            peak = memory_gb(run, lay)
            if peak > budget_gb:
                dropped[lay.name] = f"step peak {peak:.2f} GB > --budget-gb {budget_gb:g} (ulysses-mcore plan)"
                continue
        keep.append(lay)
    if not keep:
        raise ValueError(
            f"no layout of {world} ranks runs {run.model} at --seq-length {run.seq_length}"
            + (f" within --budget-gb {budget_gb:g}" if budget_gb is not None else "")
            + ": "
            + "; ".join(f"{k}: {v}" for k, v in list(dropped.items())[:3])
        )
    return keep, dropped


def _estimate(run: Run, lay: Topology) -> dict:
    """The memory model's estimate of ``run`` at ``lay``, per rank."""
    return estimate(
        seq_length=run.seq_length,
        micro_batch_size=run.micro_batch_size,
        tp=lay.tp,
        ulysses=lay.ulysses,
        cp=lay.cp,
        pp=lay.pp,
        dp=lay.dp,
        bf16=run.bf16,
        recompute=run.recompute,
        distributed_optimizer=run.distributed_optimizer,
        **run.shape.keywords(),
    )


def memory_gb(run: Run, lay: Topology) -> float:
    est = _estimate(run, lay)
    return est["total_bytes"] / 1e9


# --------------------------------------------------------------------------- features
def features(run: Run, lay: Topology, gpus_per_node: Optional[int] = None) -> Dict[str, float]:
    """Per rank, per step: the counts each phase's time is proportional to (see the module docstring).
    FLOPs from :meth:`ModelShape.work`, bytes from the memory model: counted once for every cost."""
    c, work = run.shape, run.shape.work()
    L, h = c.num_layers / lay.pp, c.hidden_size
    S, b = run.seq_length, run.micro_batch_size
    m = run.global_batch_size // (b * lay.dp)  # micro-batches per rank per step
    tokens = S * b / (lay.ulysses * lay.cp)  # per rank per micro-batch
    act = 2 if run.bf16 else 4
    est = _estimate(run, lay)
    passes = 4 if run.recompute == "full" else 3  # forward + backward (2x), + the forward again under recompute
    split = lay.tp * lay.ulysses * lay.cp  # the heads over tp x ulysses, the queries over cp
    pairs = b * S * (S + 1) / 2  # causal (query, key) pairs of a micro-batch (one document a sample)
    attn = passes * work["attention"] * pairs / split * L * m
    mlp = passes * work["mlp"] * tokens / lay.tp * L * m
    other = passes * work["projections"] * tokens / lay.tp * L * m
    other += 3 * work["logits"] * tokens / lay.tp * m  # the output layer (last stage, not recomputed)
    f = {
        "attn_flops": attn,  # busy time of each phase: what the timers measure
        "attn_rows": passes * b * S * c.num_attention_heads / split * L * m,  # per query row (softmax, tiles)
        "mlp_flops": mlp,
        "other_flops": other,
        "tokens": passes * tokens * L * m,  # per token and layer, not a matmul (norms, activations, copies)
        "micro_batches": float(m),  # per micro-batch (data, loss, schedule)
        "params": est["params_per_rank"],
        "layer_calls": L * m,  # host work per layer and micro-batch (kernel launches, Python)
        # idle time of a pipeline: (pp - 1) stage-slots of one micro-batch's work, not a phase's
        "bubble_flops": (lay.pp - 1) / m * (attn + mlp + other),
        "pp_bytes_intra": 2 * 2 * tokens * h * act * m if lay.pp > 1 else 0.0,  # activations and their grads
    }
    for kind, key, n in (("a2a", "a2a_bytes_per_layer", 4), ("ring", "ring_bytes_per_layer", 3 * lay.cp - 2)):
        link = "inter" if lay.crosses_nodes("ulysses" if kind == "a2a" else "cp", gpus_per_node) else "intra"
        f[f"{kind}_bytes_{link}"] = est[key] * L * m
        f[f"{kind}_msgs"] = (n * L * m) if est[key] else 0.0
    tp_bytes = 4 * 2 * (lay.tp - 1) / lay.tp * tokens * h * act * L * m  # 2 all-reduces fwd + 2 bwd a layer
    dpx = lay.dp * lay.ulysses * lay.cp
    dp_bytes = 2 * (dpx - 1) / dpx * est["params_per_rank"] * 4  # fp32 gradient buffer
    # half the tensor-parallel all-reduces are inside the MLP (fc2's forward, fc1's backward), half outside
    # the gradient reduction runs over dp x ulysses x cp: it crosses nodes where that group does
    for kind, axes, nbytes in (
        ("tp_mlp", "tp", tp_bytes / 2),
        ("tp", "tp", tp_bytes / 2),
        ("dp", "ulysses-cp-dp", dp_bytes),
    ):
        link = "inter" if lay.crosses_nodes(axes, gpus_per_node) else "intra"
        f[f"{kind}_bytes_{link}"] = f.get(f"{kind}_bytes_{link}", 0.0) + nbytes
    return f


# --------------------------------------------------------------------------- the model
PHASE_TERMS = {  # measured phase -> the features its time is a non-negative combination of
    "attention": ["attn_flops", "attn_rows", "layer_calls"],
    "mlp": ["mlp_flops", "layer_calls", "tp_mlp_bytes_intra", "tp_mlp_bytes_inter"],
    "a2a": ["a2a_msgs", "a2a_bytes_intra", "a2a_bytes_inter"],
    "ring": ["ring_msgs", "ring_bytes_intra", "ring_bytes_inter"],
    "optimizer": ["params"],
    "rest": [
        "const",
        "micro_batches",
        "other_flops",
        "tokens",
        "layer_calls",
        "bubble_flops",
        "pp_bytes_intra",
        "tp_bytes_intra",
        "tp_bytes_inter",
        "dp_bytes_intra",
        "dp_bytes_inter",
    ],
}


def _nnls(A: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients (active set by elimination; small problems)."""
    active = list(range(A.shape[1]))
    coef = np.zeros(A.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(A[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return coef


def row_run(row: dict, run: Run) -> Run:
    """The run a sweep's row measured: ``run`` at the row's own length (a sweep over several)."""
    return replace(run, seq_length=row.get("seq_length", run.seq_length))


def _row_features(row, run: Run, gpus_per_node=None) -> Dict[str, float]:
    f = features(row_run(row, run), Topology.parse(row["layout"]), gpus_per_node)
    f["const"] = 1.0
    return f


def fit(rows: List[dict], run: Run, gpus_per_node: Optional[int] = None) -> Dict[str, Dict[str, float]]:
    """Rates per phase, by non-negative least squares of each measured phase time on its features
    (``rest`` = step time less the measured phases), over every row -- each at its own length (a
    row's ``seq_length``, ``run``'s where it has none): one length cannot tell a fixed cost from a
    per-token one, nor a per-token one from a per-pair one.  Features are scaled to unit size first."""
    feats = [_row_features(r, run, gpus_per_node) for r in rows]
    rates = {}
    for phase, terms in PHASE_TERMS.items():
        y = np.array([_phase_time(r, phase) for r in rows])
        A = np.array([[f.get(t, 0.0) for t in terms] for f in feats])
        scale = np.where(A.max(0) > 0, A.max(0), 1.0)
        coef = _nnls(A / scale, y) / scale
        rates[phase] = dict(zip(terms, coef.tolist()))
    return rates


def _phase_time(row, phase) -> float:
    if phase == "rest":
        return row["step_s"] - sum(row.get(f"{p}_s", 0.0) for p in PHASE_TERMS if p != "rest")
    return row.get(f"{phase}_s", 0.0)


def predict(rates, run: Run, lay: Topology, gpus_per_node: Optional[int] = None) -> Dict[str, float]:
    """Predicted seconds per phase and per step."""
    f = features(run, lay, gpus_per_node)
    f["const"] = 1.0
    out = {p: sum(rates[p].get(t, 0.0) * f.get(t, 0.0) for t in terms) for p, terms in PHASE_TERMS.items()}
    out["step_s"] = sum(out.values())
    return out


def gpu_rates(preset: Dict[str, float]) -> Dict[str, Dict[str, float]]:
    """Rates of a GPU cluster from its datasheet numbers and stated efficiencies (no calibration)."""
    flop = 1.0 / (preset["tflops"] * 1e12)
    return {
        "attention": {"attn_flops": flop / preset["attn_eff"]},
        "mlp": {
            "mlp_flops": flop / preset["gemm_eff"],
            "tp_mlp_bytes_intra": 1 / (preset["intra_gbps"] * 1e9),
            "tp_mlp_bytes_inter": 1 / (preset["inter_gbps"] * 1e9),
        },
        "a2a": {
            "a2a_msgs": preset["alpha_us"] * 1e-6,
            "a2a_bytes_intra": 1 / (preset["intra_gbps"] * 1e9),
            "a2a_bytes_inter": 1 / (preset["inter_gbps"] * 1e9),
        },
        "ring": {
            "ring_msgs": preset["alpha_us"] * 1e-6,
            "ring_bytes_intra": 1 / (preset["intra_gbps"] * 1e9),
            "ring_bytes_inter": 1 / (preset["inter_gbps"] * 1e9),
        },
        "optimizer": {"params": preset["opt_ns_per_param"] * 1e-9},
        "rest": {
            "const": preset["step_overhead_ms"] * 1e-3,
            "other_flops": flop / preset["gemm_eff"],
            "layer_calls": preset["layer_us"] * 1e-6,
            "bubble_flops": flop / preset["gemm_eff"],
            "pp_bytes_intra": 1 / (preset["inter_gbps"] * 1e9),  # stages are placed across nodes
            "tp_bytes_intra": 1 / (preset["intra_gbps"] * 1e9),
            "tp_bytes_inter": 1 / (preset["inter_gbps"] * 1e9),
            "dp_bytes_intra": 1 / (preset["intra_gbps"] * 1e9),
            "dp_bytes_inter": 1 / (preset["inter_gbps"] * 1e9),
        },
    }


# datasheet peaks (dense bf16) and assumed efficiencies; bandwidths per GPU per direction, GB/s
PRESETS = {
    "h100": dict(
        tflops=989,
        attn_eff=0.45,
        gemm_eff=0.6,
        intra_gbps=450,
        inter_gbps=50,
        alpha_us=15,
        opt_ns_per_param=0.05,
        step_overhead_ms=30,
        layer_us=300,
        memory_gb=80,
        gpus_per_node=8,
    ),
    "h200": dict(
        tflops=989,
        attn_eff=0.45,
        gemm_eff=0.6,
        intra_gbps=450,
        inter_gbps=50,
        alpha_us=15,
        opt_ns_per_param=0.05,
        step_overhead_ms=30,
        layer_us=300,
        memory_gb=141,
        gpus_per_node=8,
    ),
}


def rank_correlation(a, b) -> float:
    """Spearman's rank correlation of two equally long sequences."""
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    if len(a) < 2 or ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


__all__ = [
    "Run",
    "PRESETS",
    "enumerate_layouts",
    "features",
    "fit",
    "predict",
    "gpu_rates",
    "memory_gb",
    "rank_correlation",
]
