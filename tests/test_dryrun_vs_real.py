"""The dry run checked against real tensors: the same small model and layout, sized on fake CUDA
(``dryrun.run``: the live bytes of one forward and backward) and run for real on this machine's CPU
(tests/memory_probe.py: the resident set's high-water mark over the same forward and backward, in
worlds of 2 and 4 gloo ranks), with and without the memory flags (full recompute, the chunked
loss, the tiled MLP).  The step's peak above what the rank held before it agrees within 10%: every
large number the dry run prints rests on a measured small one.

What is kept equal, and why: LayerNorm (the CPU's RMSNorm is torch's composite, which saves fp32
copies a GPU's fused kernel does not: that difference is the device's, not the dry run's); the CPU
all-to-all buffer pool off in the real run (a GPU's allocator frees what a step frees); no
``--offload-activation-checkpoints`` (on a CPU its host copies are the same memory).  Needs fake CUDA
(torch's CUDA build: the Python 3.12 leg); skipped under a CPU-only torch."""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers import run_in_session, torchrun
from ulysses_mcore.devtools import fakeworld as fw

pytestmark = [pytest.mark.spawn, pytest.mark.skipif(bool(fw.unavailable()), reason=fw.unavailable() or "-")]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = (
    "--num-layers 4 --hidden-size 256 --num-attention-heads 8 --group-query-attention --num-query-groups 4 "
    "--ffn-hidden-size 1024 --swiglu --normalization LayerNorm --vocab-size 4096 --seq-length 16384 "
    "--max-position-embeddings 16384 --micro-batch-size 1 --global-batch-size 1 --bf16"
)
MEMORY = (
    "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
    "--loss-chunk-tokens 1024 --mlp-chunk-tokens 1024"
)
LAYOUTS = {  # world -> layout flags
    2: "--ulysses-degree 2",
    4: "--tensor-model-parallel-size 2 --ulysses-degree 2",
}
CASES = [(w, mem) for w in LAYOUTS for mem in (False, True)]


def _argv(world: int, memory: bool) -> list:
    return f"--world-size {world} {LAYOUTS[world]} {MODEL} {MEMORY if memory else ''}".split()


def _name(world: int, memory: bool) -> str:
    return f"world {world}{', memory flags' if memory else ''}"


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> dict:
    """{case name: the largest rank's step bytes}, one torchrun world per world size."""
    d = tmp_path_factory.mktemp("probe")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    found = {}
    for world in LAYOUTS:
        cases, out = d / f"cases{world}.json", d / f"out{world}.json"
        cases.write_text(json.dumps([{"name": _name(world, m), "argv": _argv(world, m)} for m in (False, True)]))
        cmd = torchrun(world) + ["-m", "tests.memory_probe", str(out), str(cases)]
        rc, stdout, stderr = run_in_session(cmd, env=env, cwd=ROOT, timeout=300)
        assert rc == 0, (stdout + stderr)[-3000:]
        found |= json.loads(out.read_text())
    return found


@pytest.mark.parametrize("world,memory", CASES, ids=[_name(w, m) for w, m in CASES])
def test_the_dry_runs_step_peak_is_the_real_runs_within_10_percent(real, world, memory):
    from ulysses_mcore.cli.dryrun import build_parser
    from ulysses_mcore.megatron.trainer import dryrun

    args = build_parser().parse_args(_argv(world, memory))
    sized = dryrun.run(args, world)[0].step_gb * 1e9
    measured = real[_name(world, memory)]
    ratio = sized / measured - 1
    print(f"{_name(world, memory)}: dry run {sized / 1e6:.1f} MB, real {measured / 1e6:.1f} MB ({ratio:+.1%})")
    assert measured > 30e6, measured  # activations, not the runtime's noise, make the peak
    assert abs(ratio) < 0.10, (sized / 1e9, measured / 1e9)
