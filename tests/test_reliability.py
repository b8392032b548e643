"""Reliability of examples/pretrain_gpt.py: dead ranks, atomic checkpoints, resume, determinism, NaN guards,
SIGTERM (--exit-signal-handler)."""

import os
import signal
import time

import pytest

from tests.test_pretrain import COMMON, ROOT, launch, losses

pytestmark = pytest.mark.spawn
FAULT_SCRIPT = os.path.join(ROOT, "tests", "fault_pretrain.py")  # the trainer with faults injected from outside
SHORT = [a if a != "6" else "4" for a in COMMON]  # 4 iterations


def launch_env(nproc, args, log_dir, fault, timeout=300):
    old = os.environ.get("ULYSSES_MCORE_FAULT")
    os.environ["ULYSSES_MCORE_FAULT"] = fault
    try:
        t0 = time.time()
        r = launch(nproc, args, log_dir, timeout=timeout, script=FAULT_SCRIPT)
        return r, time.time() - t0
    finally:
        if old is None:
            os.environ.pop("ULYSSES_MCORE_FAULT", None)
        else:
            os.environ["ULYSSES_MCORE_FAULT"] = old


def _processes_in(folder, wait: float = 10.0):
    """PIDs whose working folder is ``folder`` (a run's processes), after up to ``wait`` seconds."""
    deadline = time.time() + wait
    while True:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if os.readlink(f"/proc/{pid}/cwd") == str(folder):
                    found.append(int(pid))
            except OSError:
                continue
        if not found or time.time() > deadline:
            return found
        time.sleep(0.2)


def raw_losses(log_dir):
    import csv

    with open(os.path.join(log_dir, "metrics.csv")) as f:
        return {int(r["iteration"]): r["lm_loss"] for r in csv.DictReader(f) if r["kind"] == "train"}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("reliability")
    runs = {}
    for name in ("a", "b"):  # two identical runs: determinism, and the reference curve
        d = root / name
        d.mkdir()
        r = launch(2, SHORT + ["--ulysses-degree", "2", "--save", str(d / "ckpt"), "--save-interval", "2"], d)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = d
    return root, runs


def test_same_seed_gives_bitwise_identical_losses(base):
    _, runs = base
    a, b = raw_losses(runs["a"]), raw_losses(runs["b"])
    assert a == b and len(a) == 4  # the CSV holds %.8e strings: identical text, identical floats


def test_save_killed_half_way_keeps_the_previous_checkpoint_and_resume_continues(base):
    root, runs = base
    d = root / "killed"
    d.mkdir()
    ckpt = d / "ckpt"
    r, _ = launch_env(
        2, SHORT + ["--ulysses-degree", "2", "--save", str(ckpt), "--save-interval", "2"], d, "kill_in_save@4:0"
    )
    assert r.returncode != 0
    assert not _processes_in(d), "a process of the killed run outlived it (Megatron's writer Manager?)"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert (ckpt / "iter_0000002" / "train_state.pt").exists()
    assert not (ckpt / "iter_0000004").exists() and (ckpt / "iter_0000004.tmp").exists()
    d2 = root / "resumed"
    d2.mkdir()
    r2 = launch(2, SHORT + ["--ulysses-degree", "2", "--load", str(ckpt)], d2)
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert "at iteration 2 (8 samples consumed)" in r2.stdout
    full, resumed = losses(runs["a"]), losses(d2)
    assert sorted(resumed) == [3, 4]
    for it in resumed:  # same samples (data position restored) and same state: same losses
        assert abs(resumed[it] - full[it]) <= 1e-6 * abs(full[it]), (it, resumed[it], full[it])


def test_a_rank_killed_mid_step_fails_the_job_fast(tmp_path):
    r, elapsed = launch_env(
        2, SHORT + ["--ulysses-degree", "2", "--distributed-timeout-minutes", "1"], tmp_path, "kill@3:1", timeout=180
    )
    assert r.returncode != 0
    assert "rank 1 killed at iteration 3" in r.stderr
    assert elapsed < 90, elapsed  # the survivor fails on the broken connection, far inside the timeout


def test_the_survivor_of_a_dead_peer_says_so_and_exits(tmp_path):
    from tests.test_catalogue import run_ranks

    os.environ["ULYSSES_MCORE_FAULT"] = "kill@3:1"
    try:
        t0 = time.time()
        (rc0, _, err0), (rc1, _, _) = run_ranks(
            2,
            SHORT + ["--ulysses-degree", "2", "--distributed-timeout-minutes", "1", "--log-dir", str(tmp_path)],
            tmp_path,
            timeout=120,
            script=FAULT_SCRIPT,
        )
    finally:
        os.environ.pop("ULYSSES_MCORE_FAULT", None)
    assert rc1 == -signal.SIGKILL
    assert rc0 == 4 and "error: rank 0: a collective failed at iteration 3" in err0, err0[-2000:]
    assert "a peer rank died or stopped responding" in err0
    assert time.time() - t0 < 90


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_nan_in_gradients_is_reported_with_iteration_and_rank(tmp_path, policy):
    r, _ = launch_env(2, SHORT + ["--ulysses-degree", "2", "--on-nan", policy], tmp_path, "nan@3:1")
    text = r.stdout + r.stderr
    assert "iteration 3: NaN/Inf in the loss or gradients, first on rank 1" in text
    if policy == "stop":
        assert r.returncode != 0 and "--on-nan stop" in r.stderr
        assert sorted(losses(tmp_path)) == [1, 2]
    else:
        assert r.returncode == 0 and "update skipped" in r.stdout
        assert sorted(losses(tmp_path)) == [1, 2, 3, 4]


def test_sigterm_to_the_launcher_saves_exits_0_and_resume_continues(base):
    """Megatron-LM's --exit-signal-handler, with a real signal: SIGTERM to torchrun (which passes
    it to the ranks) -> the ranks finish the iteration, agree, save, exit 0; resuming gives the
    uninterrupted run's losses (no data lost), one metrics row per iteration."""
    root, runs = base
    d = root / "sigterm"
    d.mkdir()
    args = SHORT + ["--ulysses-degree", "2", "--save", str(d / "ckpt"), "--exit-signal-handler"]
    t0 = time.time()
    r = launch(2, args, d, signal_when=("parallel axes in force", signal.SIGTERM))
    assert "exiting program after receiving SIGTERM." in r.stdout, (r.stdout + r.stderr)[-3000:]
    assert "error: " not in r.stderr, r.stderr[-3000:]  # torchrun reports the signal it got; the ranks no error
    k = int((d / "ckpt" / "latest_checkpointed_iteration.txt").read_text())
    assert 1 <= k < 4 and f"successfully saved checkpoint from iteration {k:7d}" in r.stdout
    assert time.time() - t0 < 120
    r2 = launch(2, SHORT + ["--ulysses-degree", "2", "--load", str(d / "ckpt")], d)
    assert r2.returncode == 0, r2.stderr[-3000:]
    full, got = losses(runs["a"]), losses(d)
    assert sorted(got) == [1, 2, 3, 4]  # one row per iteration across the stop
    for it in got:
        assert abs(got[it] - full[it]) <= 1e-6 * abs(full[it]), (it, got[it], full[it])
