"""Test harness: one rank of a world that runs the trainer's ``main()`` once per case, in turn.

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 python tests/pretrain_cases.py CASES.json OUT_DIR

CASES.json: ``[{"name", "argv", "write": {path: text}}]``.  Before a case every rank
writes the same ``write`` files (atomically; the same text, so the order does not matter); the
case then runs ``main(argv)`` with its own rendezvous port (``main`` starts and ends its own
process group), chosen by rank 0 when the case starts and handed to the others through
``OUT_DIR/port{i}``: a port chosen minutes ahead can meanwhile be taken by a connection of an
earlier case, and then rank 0 cannot listen on it while the others wait to connect.  Each case's
name goes to the real stderr as it starts, so a world that hangs names its case.  Each rank writes
``OUT_DIR/rank{r}.json``: per case its exit code, stdout, stderr and seconds.  One process per rank
serves many cases: the imports and the interpreter start are paid once, which keeps a catalogue of
checkpoint failures inside the suite's budget.
"""

import contextlib
import io
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.helpers import die_with_parent, free_port  # noqa: E402
from ulysses_mcore.megatron.trainer import pretrain  # noqa: E402


def main(cases_path, out_dir):
    die_with_parent()
    rank = int(os.environ["RANK"])
    with open(cases_path) as f:
        cases = json.load(f)
    results = []
    for i, case in enumerate(cases):
        for path, text in case.get("write", {}).items():
            tmp = f"{path}.rank{rank}"
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        os.environ["MASTER_PORT"] = _agreed_port(out_dir, i, rank)
        print(f"rank {rank}: case {i + 1}/{len(cases)}: {case['name']}", file=sys.__stderr__, flush=True)
        out, err = io.StringIO(), io.StringIO()
        t0 = time.time()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = pretrain.main(case["argv"])
            except SystemExit as e:
                rc = e.code
        results.append(
            {
                "name": case["name"],
                "rc": rc,
                "stdout": out.getvalue(),
                "stderr": err.getvalue(),
                "seconds": time.time() - t0,
            }
        )
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:  # after each case: partial results survive
            json.dump(results, f)


def _agreed_port(out_dir, i, rank, wait_s=120.0):
    """Case ``i``'s rendezvous port: rank 0 picks a free one now and publishes it; the others read it."""
    path = os.path.join(out_dir, f"port{i}")
    if rank == 0:
        with open(path + ".tmp", "w") as f:
            f.write(str(free_port()))
        os.replace(path + ".tmp", path)
    deadline = time.time() + wait_s
    while not os.path.exists(path):
        if time.time() > deadline:
            raise SystemExit(f"rank {rank}: rank 0 published no port for case {i} within {wait_s:.0f} s")
        time.sleep(0.02)
    with open(path) as f:
        return f.read().strip()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
