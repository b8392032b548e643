"""examples/scaling's launchers, run at a reduced size on the CPU: each script is run as written with a
recording ``torchrun`` first on PATH (so what it would launch is what is tested), then that command
runs for real on gloo with the model, the length and the degrees made small by one table -- every
other flag (the distributed optimizer, recompute, bf16, the chunked loss and MLP, checkpoints, eval)
exactly as the launcher gives it.  A flag a launcher gains without a row here runs as written."""

import math
import os
import shlex
import subprocess

import pytest

from tests.helpers import run_in_session, torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = {  # flag -> its reduced value (None: dropped)
    "--num-layers": "4",
    "--hidden-size": "64",
    "--ffn-hidden-size": "128",
    "--num-attention-heads": "8",
    "--num-query-groups": "4",
    "--seq-length": "256",
    "--max-position-embeddings": "256",
    "--global-batch-size": "2",
    "--train-iters": "2",
    "--lr-warmup-iters": "0",
    "--loss-chunk-tokens": "64",
    "--mlp-chunk-tokens": "64",
    "--attention-backend": "sdpa",  # no Transformer Engine on a CPU
    "--data-path": None,  # the embedded corpus
    "--save-interval": "2",
    "--eval-interval": "2",
    "--eval-iters": "1",
}
AXES = ("--tensor-model-parallel-size", "--ulysses-degree", "--pipeline-model-parallel-size", "--context-parallel-size")
DEGREES = {  # launcher -> (tp, ulysses, pp, ring cp) here: 4 ranks, the launcher's axes, each at most 2
    "gpt_8gpus.sh": (2, 2, 1, 1),
    "gpt_16gpus.sh": (1, 2, 2, 1),
    "gpt_32gpus_hybrid.sh": (1, 2, 1, 2),
    "gpt_64gpus.sh": (1, 2, 2, 1),
}
RECORDER = '#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$RECORD"\n'


def launched(script, tmp_path):
    """The trainer's flags the launcher hands torchrun (run as written, DATA and SAVE set)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text(RECORDER)
    (bin_dir / "torchrun").chmod(0o755)
    record = tmp_path / "argv.txt"
    env = dict(
        os.environ,
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        RECORD=str(record),
        DATA="unused",
        SAVE=str(tmp_path / "ckpt"),
    )
    subprocess.run(["bash", f"examples/scaling/{script}"], cwd=ROOT, env=env, check=True, timeout=30)
    argv = record.read_text().splitlines()
    return argv[argv.index("examples/pretrain_gpt.py") + 1 :]


def reduced(flags, degrees):
    """``flags`` with the table's values (and the degrees) in place of the launcher's."""
    table, out, i = dict(SMALL, **degrees), [], 0
    while i < len(flags):
        flag, has_value = flags[i], i + 1 < len(flags) and not flags[i + 1].startswith("--")
        if flag in table and table[flag] is not None:
            out += [flag, table[flag]] if has_value else [flag]
        elif flag not in table:
            out += flags[i : i + 1 + has_value]
        i += 1 + has_value
    return out


def test_the_table_reduces_and_keeps_every_other_flag():
    flags = "--num-layers 32 --bf16 --data-path /x --ulysses-degree 4 --clip-grad 1.0".split()
    assert (
        reduced(flags, {"--ulysses-degree": "2"}) == "--num-layers 4 --bf16 --ulysses-degree 2 --clip-grad 1.0".split()
    )


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(DEGREES))
def test_the_launcher_trains_at_a_reduced_size(script, tmp_path):
    flags = launched(script, tmp_path)
    assert {"--use-distributed-optimizer", "--recompute-granularity", "--bf16"} <= set(flags), flags
    degrees = dict(zip(AXES, map(str, DEGREES[script])))
    argv = reduced(flags, degrees) + ["--log-dir", str(tmp_path / "log")]
    cmd = torchrun(math.prod(DEGREES[script]))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    rc, out, err = run_in_session([*cmd, "examples/pretrain_gpt.py", *argv], env=env, cwd=ROOT, timeout=300)
    assert rc == 0, shlex.join(argv) + "\n" + out[-2000:] + err[-3000:]
    assert "iteration        2/       2" in out and "saved checkpoint" in (out + err).lower(), out[-2000:]
