"""``ulysses-mcore``, the one installed command: the dispatcher (help, unknown commands, each
command's own --help), and the wheel: built, installed (not editable) into a fresh environment, its
command run from another folder -- help, plan, predict and a 2-iteration pretrain."""

import os
import subprocess
import sys
import sysconfig

import pytest

from ulysses_mcore import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_help_lists_every_command(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in cli.COMMANDS)
    assert cli.main([]) == 2  # no command: the list, and a usage error


def test_unknown_command_is_named(capsys):
    assert cli.main(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_each_command_has_help_under_its_own_name(name, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([name, "--help"])
    assert e.value.code == 0
    assert f"usage: ulysses-mcore {name}" in capsys.readouterr().out


def _venv_with_wheel(tmp_path):
    """A fresh venv holding the wheel (not editable); torch and megatron-core reused from this
    environment through a path entry (its own .pth files, the editable install among them, are not read)."""
    dist = tmp_path / "dist"
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # pip must not see a checkout as installed
    run = dict(capture_output=True, text=True, timeout=600, env=clean)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), ROOT], **run)
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = dist.glob("ulysses_mcore-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, **run)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], **run)
    (tmp_path / site.stdout.strip()).joinpath("reuse_test_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    r = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", str(wheel)], **run
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return venv


@pytest.mark.slow
def test_the_wheel_installs_and_its_command_runs_from_another_folder(tmp_path):
    venv = _venv_with_wheel(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("PYTHONPATH", None)

    def cmd(*args, timeout=300):
        exe = str(venv / "bin" / "ulysses-mcore")
        return subprocess.run([exe, *args], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=timeout)

    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import ulysses_mcore; print(ulysses_mcore.__file__)"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
    )
    assert where.stdout.startswith(str(venv)), where.stdout + where.stderr  # the wheel's copy, not the checkout
    assert cmd("--help").returncode == 0
    r = cmd("plan", "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--ulysses", "2")
    assert r.returncode == 0 and "tokens per rank 2048;" in r.stdout, r.stderr[-2000:]
    r = cmd("predict", "--model", "llama8b", "--seq-length", "131072", "--gpus", "8")
    assert r.returncode == 0 and "    8 GPUs" in r.stdout, r.stderr[-2000:]
    r = cmd("pretrain", "--train-iters", "2", "--lr-warmup-iters", "0", "--log-interval", "1")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "iteration        2/       2" in r.stdout and (elsewhere / "runs" / "metrics.csv").exists()
