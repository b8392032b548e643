"""Test harness: one rank of a world that runs the trainer's ``main()`` once per case, in turn.

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 python tests/pretrain_cases.py CASES.json OUT_DIR

CASES.json: ``[{"name", "argv", "port", "write": {path: text}}]``.  Before a case every rank
writes the same ``write`` files (atomically; the same text, so the order does not matter); the
case then runs ``main(argv)`` with its own rendezvous port (``main`` starts and ends its own
process group).  Each rank writes ``OUT_DIR/rank{r}.json``: per case its exit code, stdout,
stderr and seconds.  One process per rank serves many cases: the imports and the interpreter
start are paid once, which keeps a catalogue of checkpoint failures inside the suite's budget.
"""

import contextlib
import io
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.helpers import die_with_parent  # noqa: E402
from ulysses_mcore.megatron.trainer import pretrain  # noqa: E402


def main(cases_path, out_dir):
    die_with_parent()
    rank = int(os.environ["RANK"])
    with open(cases_path) as f:
        cases = json.load(f)
    results = []
    for case in cases:
        for path, text in case.get("write", {}).items():
            tmp = f"{path}.rank{rank}"
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        os.environ["MASTER_PORT"] = str(case["port"])
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


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
