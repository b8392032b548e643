"""``ulysses-mcore dryrun``'s command (ulysses_mcore.cli.dryrun): its last line, a planted host read and
a planted device mismatch failing the run with exit 1, named with their source line (negative
controls), and a clear refusal under a CPU-only torch."""

import re

import pytest
import torch

from tests.test_dryrun import MODEL
from ulysses_mcore.devtools import fakeworld as fw

needs_fake_cuda = pytest.mark.skipif(bool(fw.unavailable()), reason=fw.unavailable() or "-")


@needs_fake_cuda
def test_the_command_prints_its_last_line(capsys):
    from ulysses_mcore.cli.dryrun import main

    assert main(MODEL + ["--ulysses-degree", "8"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(
        r"dry run: world 8, tp 1 x ulysses 8 x cp 1 x pp 1: peak [\d.]+ GB \(plan [\d.]+ GB\), forward [\d.]+ TFLOP, "
        r"all-to-all [\d.]+ GB, host memory [\d.]+ GB a node, host reads 0, device mismatches 0; "
        r"fits h100: (yes|no) \(peak [\d.]+ of 80 GB, 8% kept free\)",
        last,
    ), last


def _plant(monkeypatch, kind):
    from ulysses_mcore import call

    real = call.PreparedCall._exchanged

    def planted(self, q, k, v, tensors):
        if kind == "host read":
            q = q * float(q.detach().sum())
        else:
            q = q + torch.zeros(q.shape[-1], device="cpu")  # a CPU tensor meets the CUDA one
        return real(self, q, k, v, tensors)

    monkeypatch.setattr(call.PreparedCall, "_exchanged", planted)


@needs_fake_cuda
@pytest.mark.parametrize("kind", ["host read", "device mismatch"])
def test_a_planted_fault_fails_the_dry_run_naming_its_line(monkeypatch, capsys, kind):
    from ulysses_mcore.cli.dryrun import main

    _plant(monkeypatch, kind)
    assert main(MODEL + ["--ulysses-degree", "8"]) == 1
    out = capsys.readouterr().out
    assert f"FAILED: {kind}" in out and "test_cli_dryrun.py" in out, out[-2000:]


@pytest.mark.skipif(not fw.unavailable(), reason="this torch is a CUDA build: the dry run runs")
def test_a_cpu_build_of_torch_is_refused_with_the_fix(capsys):
    from ulysses_mcore.cli.dryrun import main

    assert main(MODEL + ["--ulysses-degree", "8"]) == 2
    err = capsys.readouterr().err
    assert "CUDA build of torch" in err and "torch==2.13.0" in err
