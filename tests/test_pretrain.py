"""examples/pretrain_gpt.py end to end under torchrun (gloo, CPU).

* ulysses 1 and ulysses 2 give the same loss line for the same seed and data (1e-4 rel);
* a checkpoint saved at ulysses 2 resumes at ulysses 1 and at tp 2 x ulysses 2, and the
  loss curve continues as if uninterrupted (1e-4 rel);
* bad flags fail fast on every rank with a clear message.
"""

import csv
import os
import subprocess
import sys

import pytest

from tests.helpers import free_port, run_in_session

pytestmark = pytest.mark.spawn
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "pretrain_gpt.py")
COMMON = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--num-query-groups",
    "2",
    "--seq-length",
    "128",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--train-iters",
    "6",
    "--lr-warmup-iters",
    "1",
    "--lr",
    "3e-3",
    "--seed",
    "7",
]


class Result:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def launch(nproc, args, log_dir, timeout=300, script=SCRIPT, signal_when=None):
    """torchrun of the pretrain script in its own session (tests.helpers.run_in_session)."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [
        torchrun,
        "--nproc-per-node",
        str(nproc),
        "--master-port",
        str(free_port()),
        script,
        *args,
        "--log-dir",
        str(log_dir),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return Result(*run_in_session(cmd, env=env, cwd=log_dir, timeout=timeout, signal_when=signal_when))


def losses(log_dir):
    with open(os.path.join(log_dir, "metrics.csv")) as f:
        return {int(r["iteration"]): float(r["lm_loss"]) for r in csv.DictReader(f) if r["kind"] == "train"}


def close(a, b, rtol=1e-4):
    return abs(a - b) <= rtol * abs(b)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("pretrain")
    out = {}
    # the uninterrupted runs: ulysses 1 (one rank) and ulysses 2 (two ranks, saving at 3 and 6)
    for name, nproc, extra in [
        ("u1", 1, []),
        ("u2", 2, ["--ulysses-degree", "2", "--save", str(base / "ckpt"), "--save-interval", "3"]),
    ]:
        d = base / name
        d.mkdir()
        r = launch(nproc, COMMON + extra, d)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        out[name] = (d, r)
    # resume the ulysses-2 checkpoint of iteration 3 at other degrees
    with open(base / "ckpt" / "latest_checkpointed_iteration.txt", "w") as f:
        f.write("3")
    for name, nproc, extra in [
        ("resume_tp2u2", 4, ["--tensor-model-parallel-size", "2", "--ulysses-degree", "2"]),
        ("resume_u1", 1, []),
    ]:
        d = base / name
        d.mkdir()
        r = launch(nproc, COMMON + extra + ["--load", str(base / "ckpt")], d)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        out[name] = (d, r)
    return out


def test_log_lines_in_megatron_format(runs):
    d, r = runs["u2"]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(" iteration")]
    assert len(lines) == 6
    for key in (
        "consumed samples:",
        "elapsed time per iteration (ms):",
        "learning rate:",
        "global batch size:",
        "lm loss:",
        "grad norm:",
        "tokens per second:",
        "peak memory (GB):",
    ):
        assert key in lines[0]
    assert "parallel axes in force: world 2 = tp 1 x ulysses 2" in r.stdout
    ls = losses(d)
    assert ls[6] < ls[1]  # it learns


def test_ulysses1_and_ulysses2_give_the_same_losses(runs):
    a, b = losses(runs["u1"][0]), losses(runs["u2"][0])
    assert sorted(a) == sorted(b) == list(range(1, 7))
    for it in a:
        assert close(b[it], a[it]), (it, a[it], b[it])


PACKED = ["--seq-length", "1024", "--train-iters", "3", "--reset-attention-mask", "--reset-position-ids"]


def test_hybrid_and_packed_runs_give_the_same_losses(runs, tmp_path):
    """ulysses 2 x ring cp 2 equals ulysses 1; packed (--reset-attention-mask) at ulysses 2 x cp 2
    equals packed at ulysses 1, and documents really are split (more documents than samples)."""
    out = {}
    for name, nproc, extra in [
        ("hybrid", 4, ["--ulysses-degree", "2", "--context-parallel-size", "2"]),
        ("packed_u1", 1, PACKED),
        ("packed_u2cp2", 4, PACKED + ["--ulysses-degree", "2", "--context-parallel-size", "2"]),
    ]:
        d = tmp_path / name
        d.mkdir()
        r = launch(nproc, COMMON + extra, d)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        out[name] = (losses(d), r.stdout)
    base = losses(runs["u1"][0])
    assert "ulysses 2 x cp 2" in out["hybrid"][1]
    for it in base:
        assert close(out["hybrid"][0][it], base[it]), (it, out["hybrid"][0][it], base[it])
    a, b = out["packed_u1"][0], out["packed_u2cp2"][0]
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for it in a:
        assert close(b[it], a[it]), (it, a[it], b[it])
    line = next(ln for ln in out["packed_u1"][1].splitlines() if "--reset-attention-mask" in ln)
    n_docs = int(line.split("; ")[-1].split()[0])
    assert n_docs > 4, line  # 4 samples in rank 0's first iteration: some documents end inside them


def test_chunked_loss_and_tiled_mlp_give_the_same_losses(runs, tmp_path):
    """--loss-chunk-tokens and --mlp-chunk-tokens at ulysses 2 (tied embedding and output weights,
    the trainer's default) follow ulysses 1 without them: 6 iterations within 1e-5."""
    r = launch(2, COMMON + ["--ulysses-degree", "2", "--loss-chunk-tokens", "48", "--mlp-chunk-tokens", "40"], tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    base, got = losses(runs["u1"][0]), losses(tmp_path)
    assert sorted(got) == list(range(1, 7))
    for it in base:
        assert close(got[it], base[it], rtol=1e-5), (it, got[it], base[it])


@pytest.mark.parametrize("name", ["resume_tp2u2", "resume_u1"])
def test_resume_at_other_degrees_continues_the_curve(runs, name):
    full = losses(runs["u2"][0])
    d, r = runs[name]
    resumed = losses(d)
    assert "resumed from" in r.stdout and "at iteration 3 (12 samples consumed)" in r.stdout
    assert sorted(resumed) == [4, 5, 6]
    for it in resumed:
        assert close(resumed[it], full[it]), (it, resumed[it], full[it])


BAD_FLAGS = [
    (["--ulysses-degree", "3"], "does not divide WORLD_SIZE(2)"),
    (
        ["--ulysses-degree", "2", "--num-attention-heads", "1", "--num-query-groups", "1"],
        "--ulysses-degree 2 does not fit",
    ),
    (["--ulysses-degree", "2", "--seq-length", "130"], "--seq-length 130"),
    (["--global-batch-size", "3"], "--global-batch-size 3"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--save-interval", "2"], "--save-interval needs --save"),
    (["--transformer-impl", "transformer_engine"], "--transformer-impl transformer_engine needs a CUDA GPU"),
    (["--eval-iters", "-1"], "--eval-iters must be >= 0"),
]


def run_main_in_process(args, monkeypatch, capsys, world_size=2):
    """The trainer's main() as rank r of ``world_size`` up to its flag checks (they run before
    torch.distributed starts, identically on every rank): (exit code, stderr)."""
    from ulysses_mcore.megatron.trainer import pretrain

    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    try:
        rc = pretrain.main(args)
    except SystemExit as e:  # argparse
        rc = e.code
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("args,needle", BAD_FLAGS, ids=[a[0] for a, _ in BAD_FLAGS])
def test_bad_flags_are_named_before_any_collective(args, needle, monkeypatch, capsys):
    rc, err = run_main_in_process(COMMON + args, monkeypatch, capsys)
    assert rc == 2 and needle in err, err[-2000:]


def test_bad_flags_fail_fast_on_every_rank(tmp_path):
    """For real: 2 ranks under torchrun both exit; a non-zero rank alone (its peer never starts)
    fails the same way, before any collective."""
    args, needle = BAD_FLAGS[0]
    r = launch(2, COMMON + args, tmp_path, timeout=120)
    assert r.returncode != 0 and needle in r.stderr, r.stderr[-2000:]
    env = dict(
        os.environ,
        RANK="1",
        LOCAL_RANK="1",
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        PYTHONWARNINGS="ignore",
    )
    r1 = subprocess.run(
        [sys.executable, SCRIPT, *COMMON, *args], capture_output=True, text=True, timeout=60, env=env, cwd=str(tmp_path)
    )
    assert r1.returncode == 2 and needle in r1.stderr, r1.stderr[-2000:]


def test_same_initial_model_for_every_layout(runs, tmp_path):
    """One --seed, one model: pp 2 and pp 2 x tp 2 start where 1 rank starts (iteration-1 loss
    within 1e-6) and follow the same curve."""
    base = losses(runs["u1"][0])
    for name, nproc, extra in [
        ("pp2", 2, ["--pipeline-model-parallel-size", "2"]),
        ("pp2tp2", 4, ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2"]),
    ]:
        d = tmp_path / name
        d.mkdir()
        r = launch(nproc, COMMON + extra, d)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        got = losses(d)
        assert close(got[1], base[1], rtol=1e-6), (name, got[1], base[1])
        for it in base:
            assert close(got[it], base[it]), (name, it, got[it], base[it])


def test_interleaved_pipeline_with_ulysses_gives_the_losses_without(tmp_path):
    """The interleaved schedule (4 layers, pp 2, chunks of 1 layer: 2 model chunks a stage) on 4
    ranks: ulysses 2 gives the losses of dp 2 on the same ranks (1e-5; dp 2 with its chunks' layer
    inputs in host memory, counted in one record a stage), and both those of the plain pipeline
    (one chunk a stage).  Its checkpoint of iteration 3 (Megatron-LM's ``model0``,
    ``model1`` entries) resumes the curve at dp 2 in chunks and in the plain pipeline (1e-5)."""
    vpp = ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--global-batch-size", "8"]
    chunks = [*vpp, "--num-layers-per-virtual-pipeline-stage", "1"]
    ckpt = str(tmp_path / "ckpt")
    out = {}
    for name, extra in [
        ("vpp u2", [*chunks, "--ulysses-degree", "2", "--save", ckpt, "--save-interval", "3"]),
        ("vpp dp2", [*chunks, "--recompute-granularity", "full", "--offload-activation-checkpoints"]),
        ("pp dp2", vpp),
        ("vpp dp2 resumed", [*chunks, "--load", ckpt]),
        ("pp dp2 resumed", [*vpp, "--load", ckpt]),
    ]:
        if name.endswith("resumed"):
            with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write("3")
        d = tmp_path / name.replace(" ", "_")
        d.mkdir()
        r = launch(4, COMMON + extra, d)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        out[name] = losses(d)
        out[name, "stdout"] = r.stdout
    assert sorted(out["vpp u2"]) == list(range(1, 7))
    report = [ln for ln in out["vpp dp2", "stdout"].splitlines() if "activation checkpoints in host memory" in ln]
    # 6 iterations x 2 micro-batches a rank x 2 chunks of 1 layer: each chunk's layer input at least
    assert report and int(report[0].split(": ")[1].split()[0]) >= 6 * 2 * 2, report
    for it, want in out["vpp dp2"].items():
        assert close(out["vpp u2"][it], want, rtol=1e-5), (it, out["vpp u2"][it], want)
        assert close(want, out["pp dp2"][it], rtol=1e-5), (it, want, out["pp dp2"][it])
    for name in ("vpp dp2 resumed", "pp dp2 resumed"):
        assert sorted(out[name]) == [4, 5, 6], name
        for it, got in out[name].items():
            assert close(got, out["vpp u2"][it], rtol=1e-5), (name, it, got, out["vpp u2"][it])


MEGATRON_LM_FAMILY = [
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--untie-embeddings-and-output-weights",
    "--disable-bias-linear",
    "--init-method-std",
    "0.01",
    "--attention-dropout",
    "0.0",
    "--hidden-dropout",
    "0.0",
    "--adam-beta1",
    "0.9",
    "--adam-beta2",
    "0.95",
    "--lr-decay-style",
    "cosine",
    "--use-mcore-models",
    "--transformer-impl",
    "local",
    "--eval-iters",
    "0",
    "--eval-interval",
    "2",
]


def test_megatron_lm_command_line_of_a_llama_style_gpt(tmp_path):
    """Megatron-LM's flags for a GQA / RMSNorm / SwiGLU / untied / bias-free GPT work, with
    --eval-iters 0 (no evaluation): ulysses 2 gives 1 rank's losses."""
    out = {}
    for name, nproc, extra in [("u1", 1, []), ("u2", 2, ["--ulysses-degree", "2"])]:
        d = tmp_path / name
        d.mkdir()
        r = launch(nproc, COMMON + MEGATRON_LM_FAMILY + extra + ["--train-iters", "3"], d)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert "validation loss" not in r.stdout
        out[name] = losses(d)
    assert sorted(out["u1"]) == [1, 2, 3]
    for it in out["u1"]:
        assert close(out["u2"][it], out["u1"][it], rtol=1e-5), (it, out["u2"][it], out["u1"][it])


def test_plot_training_draws_a_png(runs, tmp_path):
    out = tmp_path / "training.png"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "ulysses_mcore",
            "plot",
            os.path.join(runs["u1"][0], "metrics.csv"),
            os.path.join(runs["u2"][0], "metrics.csv"),
            "--label",
            "ulysses1",
            "--label",
            "ulysses2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_two_torchrun_agents_as_two_nodes_give_the_same_losses(tmp_path):
    """torchrun's own rendezvous across "nodes": two agents of 2 ranks each on this machine (c10d
    rendezvous at one endpoint), each with its own --log-dir as nodes without a shared folder have,
    train exactly as one agent of 4 ranks -- tp 2 x ulysses 2 across the two agents' ranks, the same
    loss line (each node indexes the embedded corpus for its own ranks)."""
    args = COMMON + ["--tensor-model-parallel-size", "2", "--ulysses-degree", "2", "--train-iters", "3"]
    one = tmp_path / "one_agent"
    one.mkdir()
    r = launch(4, args, one)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    two = tmp_path / "two_agents"
    two.mkdir()
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    endpoint = f"127.0.0.1:{free_port()}"
    cmd = [
        torchrun,
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        "two-agents",
        SCRIPT,
        *args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    nodes = [two / f"node{n}" for n in range(2)]
    agents = [
        subprocess.Popen(
            cmd + ["--log-dir", str(node)],
            cwd=two,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for node in nodes
    ]
    try:
        outs = [a.communicate(timeout=300)[0] for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    assert all(a.returncode == 0 for a in agents), "\n".join(o[-3000:] for o in outs)
    assert any("parallel axes in force: world 4 = tp 2 x ulysses 2" in o for o in outs), outs
    assert all((node / "data" / "kjv.idx").exists() for node in nodes)  # each node indexed the corpus
    (logged,) = [node for node in nodes if (node / "metrics.csv").exists()]
    want, got = losses(one), losses(logged)
    assert sorted(got) == sorted(want) == [1, 2, 3]
    for it in want:
        assert close(got[it], want[it], rtol=1e-6), (it, got[it], want[it])
