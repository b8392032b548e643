"""Tier 3: Megatron-LM's own pretrain_gpt.py, unchanged, through ``megatron_patches.launch``.

Megatron-LM is found through ``$MEGATRON_LM`` (the folder holding ``pretrain_gpt.py``;
``.ci/run`` points it at ``../shared/megatron-lm`` for megatron-core 0.16 and at
``../shared/megatron-lm-0.19`` for 0.19, whose wheel ships ``megatron.training``).  Each case
runs the script with ``--ulysses-degree`` and the same script at the same world size
without it (Megatron's own attention, data-parallel instead), and compares every
iteration's loss and grad norm (full precision, printed by tests/megatron_lm_probe.py
around Megatron-LM's ``train_step``) and Megatron-LM's own iteration lines.  Dropout is 0:
dropout masks depend on which rank holds which token, in Megatron's own context
parallelism too.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

from tests.helpers import free_port, run_in_session
from ulysses_mcore.megatron.compat.patches import CPU_FLAGS
from ulysses_mcore.megatron.trainer.arguments import _megatron_core

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEGATRON_LM = os.environ.get("MEGATRON_LM", "")
SCRIPT = os.path.join(MEGATRON_LM, "pretrain_gpt.py")
MISSING = [m for m in ("six", "regex", "yaml", "triton") if importlib.util.find_spec(m) is None]
REASON = (
    f"$MEGATRON_LM={MEGATRON_LM!r} holds no pretrain_gpt.py: point it at Megatron-LM "
    "(../shared/megatron-lm for megatron-core 0.16, ../shared/megatron-lm-0.19 for 0.19)"
    if not os.path.isfile(SCRIPT)
    else f"Megatron-LM needs {MISSING}: pip install -e '.[megatron-lm]'"
)

pytestmark = [pytest.mark.spawn, pytest.mark.skipif(not os.path.isfile(SCRIPT) or bool(MISSING), reason=REASON)]

TINY = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "128",
    "--max-position-embeddings",
    "128",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--lr",
    "1e-3",
    "--log-interval",
    "1",
    "--eval-iters",
    "0",
    "--eval-interval",
    "1000",
    "--seed",
    "1234",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
    "--tokenizer-type",
    "NullTokenizer",
]
MOCK = ["--mock-data", "--vocab-size", "255"]  # unless a case gives --data-path
CPU = list(CPU_FLAGS)  # Megatron-LM's flags for a CPU run
ROPE = ["--position-embedding-type", "rope"]

_RUNS: dict = {}


def run_megatron_lm(nproc: int, flags, iters: int = 4, timeout: int = 300):
    """Megatron-LM's pretrain_gpt.py on ``nproc`` gloo ranks; returns (probe rows, log rows, output)."""
    key = (nproc, tuple(flags), iters)
    if key in _RUNS:
        return _RUNS[key]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([MEGATRON_LM, ROOT]), OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-port",
        str(free_port()),
        "-m",
        "megatron_patches.launch",
        os.path.join(ROOT, "tests", "megatron_lm_probe.py"),
        SCRIPT,
        *CPU,
        *TINY,
        *([] if "--data-path" in flags else MOCK),
        "--train-iters",
        str(iters),
        *flags,
    ]
    rc, stdout, stderr = run_in_session(cmd, env=env, cwd=ROOT, timeout=timeout)
    out = stdout + stderr
    assert rc == 0, f"{' '.join(cmd)}\nexit {rc}\n{out[-6000:]}"
    probe = {int(m[1]): (float(m[2]), float(m[3])) for m in re.finditer(r"^PROBE (\d+) (\S+) (\S+)", out, re.M)}
    logged = {
        int(m[1]): (float(m[2]), float(m[3]))
        for m in re.finditer(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: (\S+) \|.*?grad norm: (\S+) \|", out)
    }
    _RUNS[key] = (probe, logged, out)
    return _RUNS[key]


def assert_same_lines(got, want, iterations, what, logged=None):
    """Probe values (loss, grad norm) within 1e-5 relative at ``iterations``; Megatron-LM's own
    printed lines at ``logged`` (default: the same iterations)."""
    (gp, gl, gout), (wp, wl, _) = got, want
    logged = iterations if logged is None else logged
    for it in iterations:
        assert it in gp and it in wp, f"{what}: iteration {it} missing\n{gout[-3000:]}"
        for name, g, w in (("loss", gp[it][0], wp[it][0]), ("grad norm", gp[it][1], wp[it][1])):
            assert abs(g - w) <= 1e-5 * abs(w), f"{what}: iteration {it} {name} {g!r} vs {w!r} without Ulysses"
    for it in logged:  # Megatron-LM's own log lines: loss to its 7 printed digits, grad norm to 3 decimals
        assert abs(gl[it][0] - wl[it][0]) <= 1e-5 * abs(wl[it][0]) and abs(gl[it][1] - wl[it][1]) <= 1.5e-3, (
            f"{what}: Megatron-LM's iteration {it} line {gl[it]} vs {wl[it]}"
        )


VPP = ["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1"]
OVERLAP_RECOMPUTE = [
    "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
]  # fmt: skip
# layout name: (world size, flags with Ulysses, the same script and world size without it)
LAYOUTS = {
    "ulysses4_rope": (4, ["--ulysses-degree", "4", *ROPE], ROPE),
    "tp2_ulysses2_distopt": (
        4,
        ["--tensor-model-parallel-size", "2", "--ulysses-degree", "2", "--use-distributed-optimizer"],
        ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"],
    ),
    "pp2_ulysses2": (
        4,
        ["--pipeline-model-parallel-size", "2", "--ulysses-degree", "2"],
        ["--pipeline-model-parallel-size", "2"],
    ),
    "ulysses2_cp2_rope": (4, ["--ulysses-degree", "2", "--context-parallel-size", "2", *ROPE], ROPE),
    # the interleaved schedule overlaps its p2p: a sent output's storage must outlive gloo's isend (cpu_compat)
    "pp2_vpp2_ulysses2": (4, [*VPP, "--ulysses-degree", "2"], VPP),
    # Megatron's memory features (docs/memory.md): sharded optimizer state, both overlaps, full recompute
    "ulysses2_distopt_overlap_recompute_offload": (
        2,
        ["--ulysses-degree", "2", *OVERLAP_RECOMPUTE, "--offload-activation-checkpoints"],
        OVERLAP_RECOMPUTE,
    ),
    "ulysses2_selective_recompute": (
        2,
        ["--ulysses-degree", "2", "--recompute-granularity", "selective"],
        ["--recompute-granularity", "selective"],
    ),
    # chunked linear cross-entropy (vocab-parallel over tp 2) and the sequence-tiled MLP
    # Megatron's sliding window (layer 2 full: --window-attn-skip-freq 2): the reference is Megatron's
    # own DotProductAttention with its sliding-window mask
    "ulysses2_window": (
        2,
        ["--ulysses-degree", "2", "--window-size", "16,0", "--window-attn-skip-freq", "2", *ROPE],
        ["--window-size", "16,0", "--window-attn-skip-freq", "2", *ROPE],
    ),
    "tp2_ulysses2_chunked": (
        4,
        [
            "--tensor-model-parallel-size",
            "2",
            "--ulysses-degree",
            "2",
            "--use-distributed-optimizer",
            "--loss-chunk-tokens",
            "20",
            "--mlp-chunk-tokens",
            "12",
        ],
        ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"],
    ),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_loss_lines_equal_without_ulysses(layout):
    world, with_u, without = LAYOUTS[layout]
    got = run_megatron_lm(world, with_u)
    assert "[ulysses-mcore] core attention: UlyssesAttention" in got[2]
    assert "[ulysses-mcore] parallel axes in force" in got[2]
    if "--loss-chunk-tokens" in with_u:
        assert "[ulysses-mcore] loss: chunked linear cross-entropy, 20 tokens at a time" in got[2]
    if "--offload-activation-checkpoints" in with_u:
        assert "[ulysses-mcore] activation checkpoints: in pinned host memory" in got[2]
    want = run_megatron_lm(world, without)
    assert "[ulysses-mcore]" not in want[2]  # no flag: Megatron-LM's own attention, untouched
    assert_same_lines(got, want, range(1, 5), layout)


FSDP2 = ["--use-torch-fsdp2", "--untie-embeddings-and-output-weights"]


@pytest.mark.skipif(
    _megatron_core() < (0, 17),
    reason="megatron-core 0.16.1's torch-FSDP2 wrapper fails without Ulysses too: its finish_grad_sync takes no "
    "force_all_reduce, which its own finalize_model_grads passes",
)
def test_torch_fsdp2_shards_over_the_ulysses_ranks_exactly():
    """Megatron's torch-FSDP2 wrapper (weights, gradients and Adam's state sharded over the
    data-parallel x context-parallel ranks, Ulysses' included): ulysses 2 x dp 2 against dp 4, the
    same 4 ranks.  The launcher leaves CUDA_DEVICE_MAX_CONNECTIONS unset for it (Megatron-LM's FSDP
    refuses 1, which context parallelism otherwise asks for)."""
    got = run_megatron_lm(4, ["--ulysses-degree", "2", *FSDP2])
    assert "[ulysses-mcore] core attention: UlyssesAttention" in got[2]
    want = run_megatron_lm(4, FSDP2)
    assert_same_lines(got, want, range(1, 5), "torch FSDP2, ulysses 2 x dp 2")


def test_dynamic_ulysses_is_refused_at_start_up_on_every_rank():
    """Megatron-LM's script with --dynamic-ulysses stops in its argument validation, before any
    collective, on both ranks, saying why and which command runs it.  Each rank runs alone, as
    torchrun would start it (RANK, WORLD_SIZE, MASTER_*), with no peer: a rank that reached a
    collective would wait for the other until the timeout.  (Under torchrun, the first rank to
    exit gets the other killed, sometimes before it prints.)"""
    from ulysses_mcore.megatron.compat.patches import DYNAMIC_REFUSED

    cmd = [sys.executable, "-m", "megatron_patches.launch", SCRIPT, *CPU, *TINY, *MOCK, "--train-iters", "2"]
    cmd += ["--ulysses-degree", "2", "--dynamic-ulysses"]
    port = str(free_port())
    for rank in ("0", "1"):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([MEGATRON_LM, ROOT]), OMP_NUM_THREADS="1")
        env.update(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        rc, stdout, stderr = run_in_session(cmd, env=env, cwd=ROOT, timeout=120)
        assert rc not in (0, -9), (rank, (stdout + stderr)[-3000:])
        assert DYNAMIC_REFUSED[:60] in stdout + stderr, (rank, (stdout + stderr)[-3000:])


def test_indexed_data_ulysses2_learned_absolute(tmp_path_factory):
    """Megatron's indexed dataset (.bin/.idx from ulysses-mcore preprocess, byte tokens 0-256)
    instead of --mock-data; NullTokenizer with --vocab-size 257 covers the ids.  Learned absolute
    positions (Megatron-LM's default; RoPE in the other cases): position_embeddings.weight must
    start the same whatever the context-parallel size."""
    prefix = str(tmp_path_factory.mktemp("indexed") / "kjv")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "ulysses_mcore",
            "preprocess",
            "--input",
            os.path.join(ROOT, "ulysses_mcore", "corpus", "kjv_genesis_exodus.jsonl"),
            "--output-prefix",
            prefix,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    data = ["--data-path", prefix, "--split", "98,2,0", "--vocab-size", "257"]
    got = run_megatron_lm(2, ["--ulysses-degree", "2", *data])
    want = run_megatron_lm(2, data)
    assert "UlyssesAttention" in got[2] and "MockGPTDataset" not in got[2]
    assert_same_lines(got, want, range(1, 5), "indexed data")


def test_ulysses2_checkpoint_resumes_at_ulysses1(tmp_path):
    """RoPE, ulysses 2: saved at iteration 4 of 6, resumed without Ulysses (data-parallel 2)
    for iterations 5-6: the same lines as an uninterrupted run without Ulysses."""
    ckpt = str(tmp_path / "ckpt")
    want = run_megatron_lm(2, ROPE, iters=6)
    saved = run_megatron_lm(
        2, ["--ulysses-degree", "2", *ROPE, "--save", ckpt, "--save-interval", "4", "--exit-interval", "4"], iters=6
    )
    assert sorted(saved[0]) == [1, 2, 3, 4] and os.path.isdir(os.path.join(ckpt, "iter_0000004"))
    assert_same_lines(saved, want, range(1, 5), "ulysses 2 before the save")
    resumed = run_megatron_lm(2, [*ROPE, "--load", ckpt], iters=6)
    assert sorted(resumed[0]) == [5, 6], resumed[2][-3000:]
    # Megatron-LM's second line of a run prints the mean of its first two iterations (its own
    # logging, with or without Ulysses): the resumed run's line 6 is the mean of 5 and 6 while the
    # uninterrupted run's is not, so its own lines are compared at iteration 5, the probe's at 5, 6
    assert_same_lines(resumed, want, range(5, 7), "resumed at ulysses 1", logged=[5])


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None, reason="needs Transformer Engine")
def test_te_spec_gives_te_kernel_inside_ulysses():
    """GPU node: --transformer-impl transformer_engine, tp 2 x ulysses 2 with --sequence-parallel."""
    if torch.cuda.device_count() < 4:
        pytest.skip("needs 4 GPUs")
    global CPU
    saved, CPU = CPU, ["--transformer-impl", "transformer_engine", "--bf16"]
    try:
        flags = ["--tensor-model-parallel-size", "2", "--sequence-parallel", *ROPE]
        got = run_megatron_lm(4, [*flags, "--ulysses-degree", "2"])
        assert "UlyssesAttention (inner kernel te)" in got[2]
        want = run_megatron_lm(4, flags)
    finally:
        CPU = saved
    for it in range(1, 5):
        assert abs(got[0][it][0] - want[0][it][0]) <= 2e-2 * abs(want[0][it][0])  # bf16, other kernels
