"""The README's code, run as written: the API example (a complete program) on 8 gloo ranks exits
clean -- every rank 0, no 'terminate called' at exit (groups kept alive past
destroy_process_group abort the process; ulysses_mcore.release() drops the package's) -- and every
`ulysses-mcore` planning command the README shows prints its answer."""

import os
import re
import shlex
import subprocess

import pytest

from tests.helpers import torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md")).read()


def test_the_api_example_is_a_complete_program():
    block = re.search(r"```python\n(# torchrun.*?)```", README, re.S).group(1)
    compile(block, "README.md", "exec")
    assert "init_process_group" in block and "destroy_process_group" in block
    assert "release()" not in block  # the package lets go of its groups at exit by itself


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [4, 8])  # the world sizes its first line names
def test_the_api_example_runs_and_exits_clean(tmp_path, ranks):
    block = re.search(r"```python\n(# torchrun.*?)```", README, re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(block)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = torchrun(ranks)
    r = subprocess.run([*cmd, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "terminate called" not in r.stderr, r.stderr[-3000:]


def _planning_commands():
    """`ulysses-mcore plan|topology|predict ...` lines of the README's bash blocks (continuations joined)."""
    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line.split("#")[0])
            if words[:1] == ["ulysses-mcore"] and words[1:2] and words[1] in ("plan", "topology", "predict"):
                cmds.append([w for w in words if not (w.startswith("[") or w.endswith("]"))])
    return cmds


def test_the_readme_planning_commands_run():
    from ulysses_mcore import cli

    cmds = _planning_commands()
    assert cmds, "the README shows planning commands"
    for words in cmds:
        assert cli.main(words[1:]) == 0, words
