"""Every command README.md and docs/*.md show -- fenced shell blocks, Python examples, inline commands a
user would run -- is either run here as written (with a short-run override where the line below says
so) or listed with the reason it cannot run in the suite (a GPU, a cluster, Megatron-LM's checkout, the
network, or more than a few minutes).  A command the docs gain later fails the first test until it is
classified in CATALOGUE."""

import glob
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)  # this venv's bin: the installed ulysses-mcore, torchrun
COMMAND = re.compile(r"(?:[A-Z_]+=\S+ )*(?:python3?|ulysses-mcore|bash|torchrun|git|pip|\.venv\d*/bin/\S+)(?: |$)")


def collect():
    """``[(file, kind, command)]``: shell lines (continuations joined, comments dropped), the first line
    of each Python example, inline spans that start like a command."""
    found = []
    for path in ["README.md", *sorted(glob.glob("docs/*.md", root_dir=ROOT))]:
        text = open(os.path.join(ROOT, path)).read()
        for lang, body in re.findall(r"```(\w*)\n(.*?)```", text, re.S):
            if lang in ("bash", "sh"):
                for line in re.sub(r"\\\n\s*", " ", body).splitlines():
                    line = re.sub(r"\s+#.*$", "", line.strip())
                    if line and not line.startswith("#"):
                        found.append((path, "shell", line))
            elif lang == "python":
                found.append((path, "python", body.splitlines()[0]))
        prose = re.sub(r"```.*?```", "", text, flags=re.S).replace("\n", " ")
        found += [(path, "inline", span) for span in re.findall(r"`([^`]+)`", prose) if COMMAND.match(span)]
    return found


GPU = "needs a GPU (tools/device_check.sh runs it on a lease; its CPU smoke run: tests/test_tools_device_check.py)"
LONG = "a benchmark: more than a few minutes on this machine (its results are committed in docs/perf)"
CATALOGUE = [  # (pattern the command matches, "run" with its runner, or the reason it is only listed)
    (r"^python3 -m venv \.venv && ", "the quick start: CI runs both commands (.ci/run), from a fresh venv"),
    (r"^(\.venv/bin/)?pip (install|download)", "installs packages: CI's own set-up runs it"),
    (r"^git clone ", "needs the network (CI keeps the same checkouts in ../shared)"),
    (r"^MEGATRON_LM=\S+ \.venv/bin/python -m pytest", "the suite itself, in CI's two legs (.ci/run)"),
    (r"^(\.venv/bin/)?python -m pytest", "the suite itself"),
    (r"^PYTHONPATH=\$MEGATRON_LM torchrun --nproc-per-node 8", "needs an 8-GPU node"),
    (
        r"^PYTHONPATH=\.\./megatron-lm ",
        "needs Megatron-LM's checkout: tests/test_megatron_lm.py runs it with $MEGATRON_LM",
    ),
    (r"^DEVICE_CHECK_CPU=1 bash tools/device_check\.sh DIR", "the suite runs it (tests/test_tools_device_check.py)"),
    (r"^python tools/gpu_model_check\.py --device cpu --quick", "the suite runs it (test_tools_gpu_model_check.py)"),
    (r"^bash tools/device_check\.sh", GPU),
    (r"^bash tools/device_node_check\.sh", "needs an 8-GPU node (its CPU smoke run: tests/test_tools_device_check.py)"),
    (r"^bash tools/device_prepare\.sh", "needs the network (downloads wheels for a GPU lease)"),
    (r"^python tools/bench_", LONG),
    (r"^ulysses-mcore sweep ", "measures every layout: minutes (tests/test_cli_scaling.py runs a small sweep)"),
    (r"^ulysses-mcore plan --loss-chunk-tokens C", "a pattern (C = the chunk), not a command"),
    (r"^ulysses-mcore plan --longest$", "a command's name in prose (its full form is run: docs/memory.md)"),
    (r"^ulysses-mcore plan --longest .*--world-size N ", "a pattern (N GPUs, the model's flags), not a command"),
    (r"^(ulysses-mcore|torchrun|ulysses-mcore (plan|pretrain|dryrun|fit|preprocess))$", "a command's name in prose"),
    (r"^torchrun --nproc-per-node N ", "a pattern (N ranks, flags elided), not a command"),
    (r"^torchrun --nnodes N ", "a multi-node pattern (N nodes, HOST:PORT): needs a cluster"),
    (r"^ulysses-mcore --help$", "run"),
    (r"^ulysses-mcore pretrain --timing$", "run"),  # 4 iterations
    (r"^# torchrun --nproc-per-node 4 example\.py", "the API example: tests/test_readme.py runs it on 4 and 8 ranks"),
    (r"^topo = ulysses_mcore\.initialize", "a fragment of a 16-rank world (tests/test_groups.py builds these groups)"),
    (r"^pip install torch==2\.13\.0$", "installs packages"),
    (r"^(\.venv312/bin/)?ulysses-mcore dryrun --world-size", "run"),
    (r"^(\.venv/bin/)?ulysses-mcore (plan|topology|predict) --", "run"),
    (r"^ulysses-mcore report --preset h200$", "run"),  # with --report into a temporary folder
    (r"^ulysses-mcore fit --out docs/perf/sweep_w4$", "run"),  # on a copy of the committed sweep
    (r"^ulysses-mcore fit --out DIR", "a pattern (DIR: the calibration's folder), not a command"),
    (
        r"^ulysses-mcore fit --out runs/",
        "fits the sweeps the lines before it measure (tests/test_cli_scaling.py fits one)",
    ),
    (r"^ulysses-mcore preprocess --input corpus\.jsonl", "run"),  # on a small corpus.jsonl in a temporary folder
    (r"^\.venv/bin/torchrun --nproc-per-node 4 --no-python \.venv/bin/ulysses-mcore pretrain", "run"),  # 4 iterations
    (r"^python tools/profile_call\.py --world 2 --calls 300$", "run"),  # 20 calls
]


def disposition(cmd: str) -> str:
    for pattern, what in CATALOGUE:
        if re.search(pattern, cmd):
            return what
    return ""


def test_every_documented_command_is_run_or_listed_with_its_reason():
    unknown = sorted({f"{path}: {cmd}" for path, _, cmd in collect() if not disposition(cmd)})
    assert not unknown, "classify these in tests/test_docs.py's CATALOGUE:\n" + "\n".join(unknown)


RUNNABLE = sorted({cmd for _, _, cmd in collect() if disposition(cmd) == "run"})


def _argv(cmd: str, tmp) -> list:
    """The command as written, with the short-run overrides the catalogue names."""
    words = cmd.split()
    words[0] = os.path.join(BIN, os.path.basename(words[0])) if "/" in words[0] else words[0]
    if words[0] == "python":
        words[0] = sys.executable
    elif not os.path.isabs(words[0]):
        words[0] = os.path.join(BIN, words[0])
    words = [os.path.join(BIN, os.path.basename(w)) if w.startswith(".venv") else w for w in words]
    if "report" in words:
        words += ["--report", str(tmp / "report.md")]
    if "fit" in words:
        shutil.copytree(os.path.join(ROOT, "docs/perf/sweep_w4"), tmp / "sweep_w4")
        words[words.index("--out") + 1] = str(tmp / "sweep_w4")
    if "preprocess" in words:
        (tmp / "corpus.jsonl").write_text('{"text": "In the beginning"}\n{"text": "And the earth"}\n')
    if "pretrain" in words:
        words += ["--train-iters", "4", "--log-dir", str(tmp / "run")]  # 4: past the 3 warm-up steps
    if "profile_call.py" in cmd:
        words[words.index("--calls") + 1] = "20"
    return words


@pytest.mark.slow
@pytest.mark.parametrize("cmd", RUNNABLE)
def test_a_documented_command_runs(tmp_path, cmd):
    if "dryrun" in cmd and torch.version.cuda is None:
        pytest.skip("the dry run needs torch's CUDA build (the Python 3.12 leg runs it)")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cwd = tmp_path if "preprocess" in cmd else ROOT
    proc = subprocess.run(_argv(cmd, tmp_path), cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (cmd, proc.stdout[-2000:], proc.stderr[-3000:])
