"""``ulysses-mcore``: the one installed command.

    ulysses-mcore pretrain [flags]        train a GPT (Megatron-LM's flags + --ulysses-degree); torchrun it
    ulysses-mcore dryrun [flags]          the model at full size on fake CUDA (no GPU): kernels, memory, FLOPs
    ulysses-mcore plan [flags]            per-rank memory, all-to-all bytes, longest sequence in a budget
    ulysses-mcore topology [flags]        the groups of a layout, what crosses a node, heads and tokens
    ulysses-mcore sweep|fit|predict|report [flags]   measure layouts, calibrate and use the step-time model
    ulysses-mcore preprocess [flags]      text / JSONL -> Megatron's indexed dataset
    ulysses-mcore plot [flags]            loss and tokens/s of a run's metrics.csv -> PNG

``ulysses-mcore COMMAND --help`` for each command's flags.  ``python -m ulysses_mcore`` is the
same command.  Each command's code is imported only when it runs (the planners need no Megatron).
"""

from __future__ import annotations

import importlib
import sys
from typing import List, Optional

# command -> (module with main(argv), one line of help, whether the module's own parser takes the command word)
COMMANDS = {
    "pretrain": ("ulysses_mcore.megatron.trainer.pretrain", "train a GPT with Megatron-Core and Ulysses (run under torchrun)", False),
    "dryrun": ("ulysses_mcore.cli.dryrun", "the trainer's model at cluster size on fake CUDA: kernels, host reads, memory, FLOPs", False),
    "plan": ("ulysses_mcore.cli.plan", "per-rank memory and all-to-all bytes; the longest sequence that fits", False),
    "topology": ("ulysses_mcore.cli.topology", "process groups of a layout, node crossings, heads and tokens", False),
    "sweep": ("ulysses_mcore.cli.scaling", "measure every layout of a world (resumable)", True),
    "fit": ("ulysses_mcore.cli.scaling", "calibrate the step-time model on a sweep; its held-out error", True),
    "predict": ("ulysses_mcore.cli.scaling", "best layouts of a GPU cluster for a model and sequence", True),
    "report": ("ulysses_mcore.cli.scaling", "best layouts for 8B / 70B at 128K-1M on 8-1024 GPUs", True),
    "preprocess": ("ulysses_mcore.cli.preprocess", "text or JSONL -> Megatron's indexed dataset (.bin/.idx)", False),
    "plot": ("ulysses_mcore.cli.plot", "draw loss and tokens/s of metrics.csv files into a PNG", False),
}  # fmt: skip


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: ulysses-mcore COMMAND [flags]   (ulysses-mcore COMMAND --help for its flags)", "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text, _) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"ulysses-mcore: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module, _, takes_word = COMMANDS[name]
    saved = sys.argv[0]
    sys.argv[0] = "ulysses-mcore" if takes_word else f"ulysses-mcore {name}"  # argparse's prog in usage lines
    try:
        return importlib.import_module(module).main([name, *rest] if takes_word else rest) or 0
    finally:
        sys.argv[0] = saved


__all__ = ["main", "COMMANDS"]
