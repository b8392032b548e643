"""A calibration: the step-time model's rates fitted on measured sweeps, and what they were fitted on.

``ulysses-mcore fit --out DIR`` writes ``DIR/calibration.json``; ``predict``, ``plan --budget-gb``,
``report`` and ``pretrain --dynamic-ulysses`` read it with ``--calibration FILE``.  The record keeps
the rates per phase (:data:`ulysses_mcore.planning.step_time.PHASE_TERMS`), the model and batch the
sweeps ran, the lengths, worlds and layouts measured, and the in-sample error -- so every
prediction can say how far it reaches beyond what was measured (:meth:`Calibration.reach`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Tuple

FORMAT = "ulysses-mcore calibration 1"


class CalibrationError(ValueError):
    """A calibration file that cannot be read: the message names ``--calibration``, the file and the fix."""


@dataclass
class Calibration:
    rates: Dict[str, Dict[str, float]]
    model: str
    micro_batch_size: int
    global_batch_size: int
    lengths: List[int]
    worlds: List[int]
    layouts: List[str]
    in_sample_max_err: float
    sweeps: List[str] = field(default_factory=list)
    format: str = FORMAT

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=1)
            f.write("\n")

    @classmethod
    def load(cls, path: str) -> Calibration:
        fix = "write one with `ulysses-mcore fit --out DIR` (DIR/calibration.json)"
        try:
            with open(path) as f:
                rec = json.load(f)
        except FileNotFoundError:
            raise CalibrationError(f"--calibration {path}: no such file; {fix}") from None
        except (OSError, ValueError) as e:
            raise CalibrationError(f"--calibration {path}: unreadable ({e}); {fix}") from None
        if not isinstance(rec, dict) or rec.get("format") != FORMAT:
            raise CalibrationError(f"--calibration {path}: not a calibration ({FORMAT!r} expected); {fix}")
        missing = [k for k in cls.__dataclass_fields__ if k not in rec]
        if missing:
            raise CalibrationError(f"--calibration {path}: lacks {', '.join(missing)}; {fix}")
        return cls(**{k: rec[k] for k in cls.__dataclass_fields__})

    def reach(self, seq_length: int, world: int) -> Tuple[float, float]:
        """How far a prediction at ``seq_length`` on ``world`` ranks lies beyond the calibration: the
        factor past its longest (or below its shortest) length, and past its largest world (1.0: inside)."""
        lo, hi = min(self.lengths), max(self.lengths)
        length = seq_length / hi if seq_length > hi else (lo / seq_length if seq_length < lo else 1.0)
        return length, max(1.0, world / max(self.worlds))

    def reach_text(self, seq_length: int, world: int) -> str:
        length, world_x = self.reach(seq_length, world)
        lengths = ",".join(str(n) for n in self.lengths)
        if length == 1.0 and world_x == 1.0:
            return f"inside the calibration (lengths {lengths}, worlds {self.worlds})"
        parts = []
        if length != 1.0:
            parts.append(f"{length:.1f}x beyond the calibrated lengths {lengths}")
        if world_x != 1.0:
            parts.append(f"{world_x:.0f}x the largest calibrated world {max(self.worlds)}")
        return "extrapolates " + " and ".join(parts)


__all__ = ["Calibration", "CalibrationError", "FORMAT"]
