"""A calibration record (ulysses_mcore.planning.calibration): written and read back unchanged, how far
a prediction reaches beyond it, and files that are not one refused by name with the fix."""

import json

import pytest

from ulysses_mcore.planning.calibration import Calibration, CalibrationError
from ulysses_mcore.planning.step_time import PRESETS, gpu_rates


def _cal(**kw):
    base = dict(
        rates=gpu_rates(PRESETS["h200"]),
        model="tiny",
        micro_batch_size=1,
        global_batch_size=4,
        lengths=[512, 1024],
        worlds=[2],
        layouts=["tp1-u2-cp1-pp1-dp1"],
        in_sample_max_err=0.03,
    )
    return Calibration(**{**base, **kw})


def test_saved_and_loaded_unchanged(tmp_path):
    path = str(tmp_path / "calibration.json")
    _cal(sweeps=["a/sweep.json"]).save(path)
    assert Calibration.load(path) == _cal(sweeps=["a/sweep.json"])


def test_reach_says_how_far_a_prediction_extrapolates():
    cal = _cal()
    assert cal.reach(1024, 2) == (1.0, 1.0) and cal.reach_text(768, 2).startswith("inside the calibration")
    assert cal.reach(4096, 8) == (4.0, 4.0)
    assert cal.reach_text(4096, 8) == (
        "extrapolates 4.0x beyond the calibrated lengths 512,1024 and 4x the largest calibrated world 2"
    )
    assert cal.reach(128, 2) == (4.0, 1.0)  # below the shortest length is a reach too


@pytest.mark.parametrize(
    "text,needle",
    [
        (None, "no such file"),
        ("not json", "unreadable"),
        (json.dumps({"rates": {}}), "not a calibration"),
        (json.dumps({"format": "ulysses-mcore calibration 1", "rates": {}}), "lacks model"),
    ],
)
def test_files_that_are_not_a_calibration_are_refused_with_the_fix(tmp_path, text, needle):
    path = tmp_path / "c.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(CalibrationError, match=f"--calibration {path}: {needle}") as e:
        Calibration.load(str(path))
    assert "ulysses-mcore fit --out DIR" in str(e.value)
