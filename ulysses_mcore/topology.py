"""Pure rank math for Ulysses x tensor x pipeline x data x context x expert parallelism.

No torch.distributed here: a :class:`Topology` is a grid of ranks, enumerated with the
first axis of ``order`` varying fastest (Megatron-Core's convention).  Worked example,
world 16, ``tp=2, ulysses=2, pp=2`` (so ``dp=2``), default order
``tp-ulysses-cp-ep-dp-pp``::

    rank = tp_rank + 2 * ulysses_rank + 4 * dp_rank + 8 * pp_rank

    groups("tp")      = [[0, 1], [2, 3], [4, 5], ...]          contiguous, inside a node
    groups("ulysses") = [[0, 2], [1, 3], [4, 6], [5, 7], ...]  right after TP
    groups("dp")      = [[0, 4], [1, 5], [2, 6], [3, 7], ...]
    groups("pp")      = [[0, 8], [1, 9], ...]

Ulysses x ring ``cp`` together *is* Megatron-Core's context-parallel axis, Ulysses its
inner (contiguous) level: ``groups("ulysses-cp")`` equals Megatron's ``cp`` groups and
``groups("ulysses")`` its first hierarchical-CP level.  For every axis Megatron shares,
the groups are exactly those of Megatron-Core's ``RankGenerator`` (tested).

Expert parallelism lives on its own grid, as in Megatron: ``tp, ep, edp, pp`` where
``edp = world / (tp * ep * pp)`` is the expert-data-parallel axis; ask for
``groups("ep")``, ``groups("tp-ep")``, ``groups("edp")`` ...
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Dict, List, Optional

import numpy as np

from .exchange.heads import head_layout_error

AXES = ("tp", "ulysses", "cp", "ep", "dp", "pp")
DEFAULT_ORDER = "tp-ulysses-cp-ep-dp-pp"
FLAGS = {
    "tp": "--tensor-model-parallel-size",
    "ulysses": "--ulysses-degree",
    "cp": "--context-parallel-size",
    "pp": "--pipeline-model-parallel-size",
    "ep": "--expert-model-parallel-size",
}


class TopologyError(ValueError):
    """A parallel configuration that cannot be laid out; the message names every factor."""


def _grid_groups(sizes: List[int], mask: List[bool]) -> np.ndarray:
    """Rank groups of an axis set on a grid whose first axis varies fastest.

    Row ``i`` is the group with index ``i`` over the unmasked axes (first fastest); within
    a row, ranks follow the masked axes (first fastest) -- Megatron's enumeration."""
    world = prod(sizes)
    n = len(sizes)
    grid = np.arange(world, dtype=np.int64).reshape(sizes[::-1]).transpose(range(n - 1, -1, -1))
    masked = [i for i in range(n) if mask[i]]
    other = [i for i in range(n) if not mask[i]]
    perm = other[::-1] + masked[::-1]
    group_size = prod(sizes[i] for i in masked)
    return grid.transpose(perm).reshape(world // group_size, group_size)


@dataclass(frozen=True)
class Topology:
    """Degrees of every parallel axis over ``world_size`` ranks; ``dp`` is derived."""

    world_size: int
    tp: int = 1
    ulysses: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    order: str = DEFAULT_ORDER
    dp: int = field(init=False)
    axes: tuple = field(init=False)

    def __post_init__(self):
        degrees = {a: getattr(self, a) for a in ("tp", "ulysses", "cp", "pp", "ep")}
        for name, val in [("world_size", self.world_size), *degrees.items()]:
            if not isinstance(val, (int, np.integer)) or isinstance(val, bool) or val < 1:
                flag = FLAGS.get(name, name)
                raise TopologyError(f"{flag} must be an integer >= 1, got {val!r}")
        tokens = self._axis_order(degrees)
        dp = self._data_parallel(tokens)
        object.__setattr__(self, "order", "-".join(tokens))
        object.__setattr__(self, "dp", dp)
        object.__setattr__(self, "axes", tuple(tokens))

    def _axis_order(self, degrees) -> list:
        """``order`` as a full list of axes (missing ones of degree 1 appended), or the error."""
        tokens = [t.strip() for t in self.order.lower().split("-")]
        unknown = [t for t in tokens if t not in AXES]
        if unknown:
            raise TopologyError(
                f"order {self.order!r} has unknown axis {unknown}: use a '-'-joined permutation of {list(AXES)}"
            )
        dup = sorted({t for t in tokens if tokens.count(t) > 1})
        if dup:
            raise TopologyError(f"order {self.order!r} names {dup} more than once")
        for a in AXES:
            if a not in tokens:
                if a != "dp" and degrees.get(a, 1) > 1:
                    raise TopologyError(
                        f"order {self.order!r} lacks axis {a!r} but {FLAGS[a]} is {degrees[a]}: add {a!r} to the order"
                    )
                tokens.append(a)
        if tokens.index("cp") != tokens.index("ulysses") + 1:
            raise TopologyError(
                f"order {self.order!r}: 'cp' must come right after 'ulysses' (Ulysses is the inner, "
                "contiguous level of Megatron's context-parallel axis), e.g. tp-ulysses-cp-ep-dp-pp"
            )
        return tokens

    def _data_parallel(self, tokens) -> int:
        """The derived data-parallel size, or the error naming the degrees that do not fit."""
        model = self.tp * self.ulysses * self.cp * self.pp
        if self.world_size % model:
            raise TopologyError(
                f"tp({self.tp}) * ulysses({self.ulysses}) * cp({self.cp}) * pp({self.pp}) = {model} "
                f"does not divide WORLD_SIZE({self.world_size}): change a degree or the number of ranks"
            )
        expert = self.tp * self.ep * self.pp
        if self.world_size % expert:
            raise TopologyError(
                f"tp({self.tp}) * ep({self.ep}) * pp({self.pp}) = {expert} does not divide "
                f"WORLD_SIZE({self.world_size}): change {FLAGS['ep']}"
            )
        dp, edp = self.world_size // model, self.world_size // expert
        if not (tokens[-1] == "pp" or self.pp == 1 or edp == dp):
            raise TopologyError(
                f"order {self.order!r}: with pp({self.pp}) > 1 not last, Megatron needs the expert "
                f"data-parallel size ({edp}) to equal the data-parallel size ({dp}); put 'pp' last"
            )
        return dp

    # ------------------------------------------------------------------ a layout by name
    @classmethod
    def of(cls, tp: int = 1, ulysses: int = 1, cp: int = 1, pp: int = 1, dp: int = 1, **kw) -> Topology:
        """The topology of these degrees, its world their product (a layout, as plan and sweep name it)."""
        return cls(tp * ulysses * cp * pp * dp, tp=tp, ulysses=ulysses, cp=cp, pp=pp, **kw)

    @property
    def name(self) -> str:
        """``tpT-uU-cpC-ppP-dpD`` (``-epE`` appended with experts): the layout's name in sweeps and tables."""
        text = f"tp{self.tp}-u{self.ulysses}-cp{self.cp}-pp{self.pp}-dp{self.dp}"
        return text + (f"-ep{self.ep}" if self.ep > 1 else "")

    @classmethod
    def parse(cls, name: str) -> Topology:
        """The topology a layout name spells (the inverse of :attr:`name`)."""
        try:
            parts = {p.rstrip("0123456789"): int(p[len(p.rstrip("0123456789")) :]) for p in name.split("-")}
            sizes = {k: parts.pop(k) for k in ("tp", "u", "cp", "pp", "dp")}
            if set(parts) - {"ep"}:
                raise KeyError(sorted(parts))
        except (KeyError, ValueError):
            raise ValueError(f"layout {name!r}: write it as tpT-uU-cpC-ppP-dpD, e.g. tp2-u2-cp1-pp1-dp1") from None
        return cls.of(sizes["tp"], sizes["u"], sizes["cp"], sizes["pp"], sizes["dp"], ep=parts.get("ep", 1))

    def flags(self) -> List[str]:
        """The trainer's flags of these degrees (the world is the launcher's)."""
        out = []
        for axis in ("tp", "ulysses", "cp", "pp", "ep"):
            if axis != "ep" or self.ep > 1:
                out += [FLAGS[axis], str(self.size(axis))]
        return out

    def crosses_nodes(self, axes: str, gpus_per_node: Optional[int]) -> bool:
        """Whether a group of ``axes`` ('ulysses', 'dp-ulysses-cp', ...) holds ranks of more than one
        node of ``gpus_per_node`` consecutive ranks (none: one node)."""
        if not gpus_per_node:
            return False
        nodes = self.group_array(axes) // gpus_per_node
        return bool((nodes != nodes[:, :1]).any())

    # ------------------------------------------------------------------ sizes
    @property
    def edp(self) -> int:
        """Expert-data-parallel size (Megatron's expert grid: tp, ep, edp, pp)."""
        return self.world_size // (self.tp * self.ep * self.pp)

    @property
    def context_parallel_size(self) -> int:
        """Megatron's context-parallel size: Ulysses x ring."""
        return self.ulysses * self.cp

    def size(self, axis: str) -> int:
        return self.edp if axis == "edp" else getattr(self, axis)

    def megatron_order(self) -> str:
        """The order string Megatron-Core's parallel_state takes ('ulysses-cp' -> 'cp')."""
        return "-".join(t for t in self.axes if t != "ulysses")

    def _grid(self, tokens):
        """(axis names, sizes) of the grid that ``tokens`` live on: decoder or expert."""
        if any(t in ("ep", "edp") for t in tokens):
            bad = [t for t in tokens if t in ("ulysses", "cp", "dp")]
            if bad:
                raise TopologyError(
                    f"axes {tokens}: {bad} do not exist on the expert grid (tp, ep, edp, pp); "
                    "ask for them without 'ep'/'edp'"
                )
            names = ["edp" if a == "dp" else a for a in self.axes if a not in ("ulysses", "cp")]
            return names, [self.size(n) for n in names]
        return list(self.axes), [1 if n == "ep" else self.size(n) for n in self.axes]

    # ------------------------------------------------------------------ groups
    def group_array(self, axes: str) -> np.ndarray:
        """Like :meth:`groups`, as an int64 array ``[num_groups, group_size]``."""
        tokens = [t.strip() for t in axes.lower().split("-") if t.strip()]
        for t in tokens:
            if t not in AXES and t != "edp":
                raise TopologyError(f"unknown axis {t!r} in {axes!r}: use {list(AXES) + ['edp']}")
        names, sizes = self._grid(tokens)
        return _grid_groups(sizes, [n in tokens for n in names])

    def groups(self, axes: str) -> List[List[int]]:
        """Rank lists of an axis or a '-'-joined set of axes ('ulysses', 'dp-ulysses-cp', ...)."""
        return self.group_array(axes).tolist()

    def group_of(self, axes: str, rank: int) -> List[int]:
        """The group of ``axes`` that holds ``rank``."""
        c = self.coords(rank)
        tokens = [t.strip() for t in axes.lower().split("-")]
        names, sizes = self._grid(tokens)
        expert = "edp" in names
        fixed = {n: (c[n] if expert or n != "ep" else 0) for n in names if n not in tokens}
        # index of the group over the unmasked axes (first fastest)
        idx, stride = 0, 1
        for n, s in zip(names, sizes):
            if n not in tokens:
                idx += fixed[n] * stride
                stride *= s
        return self.group_array(axes)[idx].tolist()

    def coords(self, rank: int) -> Dict[str, int]:
        """Coordinates of ``rank`` on every axis (``ep``/``edp`` from the expert grid)."""
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank} is outside WORLD_SIZE({self.world_size})")
        out: Dict[str, int] = {}
        for grid in (["tp"], ["ep"]):
            names, sizes = self._grid(grid)
            r = rank
            for n, s in zip(names, sizes):
                if grid == ["tp"] or n in ("ep", "edp"):
                    out[n] = r % s
                r //= s
        return out

    def rank(self, **coords: int) -> int:
        """Global rank of the given coordinates on tp/ulysses/cp/dp/pp (missing ones are 0), so
        ``rank(**coords(r)) == r``: the expert grid's ``ep`` / ``edp`` (derived, not independent)
        may be passed too and must agree with the rank the others give."""
        expert = {k: coords.pop(k) for k in ("ep", "edp") if k in coords}
        bad = [k for k in coords if k not in AXES]
        if bad:
            raise TopologyError(
                f"rank() takes coordinates on {[a for a in AXES if a != 'ep']} (and ep, edp), got {bad}"
            )
        r = self._dense_rank(coords)
        wrong = {k: v for k, v in expert.items() if self.coords(r)[k] != v}
        if wrong:
            raise TopologyError(
                f"{wrong} disagree with rank {r} of {coords}: its expert coordinates are {self.coords(r)}"
            )
        return r

    def _dense_rank(self, coords: Dict[str, int]) -> int:
        r, stride = 0, 1
        for a in self.axes:
            s = 1 if a == "ep" else self.size(a)
            c = coords.get(a, 0)
            if not 0 <= c < s:
                raise TopologyError(f"coordinate {a}={c} is outside 0..{s - 1}")
            r += c * stride
            stride *= s
        return r

    def describe(self) -> str:
        """One line stating the axes in force, for start-up logs."""
        parts = [f"{a} {self.size(a)}" for a in self.axes if a != "ep"]
        text = f"world {self.world_size} = " + " x ".join(parts)
        if self.ep > 1:
            text += f"; experts: tp {self.tp} x ep {self.ep} x edp {self.edp} x pp {self.pp}"
        return text + f" (order {self.order})"

    # ------------------------------------------------------------------ model checks
    def check_model(
        self,
        num_attention_heads: int,
        num_query_groups: Optional[int] = None,
        seq_length: Optional[int] = None,
        load_balanced: Optional[bool] = None,
    ) -> None:
        """Raise :class:`TopologyError` if the model cannot be laid out on this topology."""
        groups = num_query_groups or num_attention_heads
        if num_attention_heads % self.tp or groups % self.tp:
            raise TopologyError(
                f"--tensor-model-parallel-size {self.tp} must divide --num-attention-heads "
                f"{num_attention_heads} and --num-query-groups {groups}"
            )
        q, kv = num_attention_heads // self.tp, groups // self.tp
        err = head_layout_error(q, kv, self.ulysses)
        if err:
            raise TopologyError(
                f"--ulysses-degree {self.ulysses} does not fit {q} query / {kv} kv heads per "
                f"tensor-parallel rank (tp={self.tp}, heads={num_attention_heads}, "
                f"query groups={groups}): {err}"
            )
        if seq_length is not None:
            lb = (self.context_parallel_size > 1) if load_balanced is None else load_balanced
            need = self.context_parallel_size * (2 if lb else 1)
            if seq_length % need:
                why = " x 2 (load-balanced chunks)" if lb else ""
                raise TopologyError(
                    f"--seq-length {seq_length} must be divisible by ulysses({self.ulysses}) x "
                    f"cp({self.cp}){why} = {need}: use a multiple of {need} (pad with masked tokens)"
                )
