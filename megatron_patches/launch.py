"""Run Megatron-LM's pretrain_gpt.py (or any script calling megatron.training.pretrain) with Ulysses.

    torchrun --nproc-per-node 8 -m megatron_patches.launch /path/to/Megatron-LM/pretrain_gpt.py \
        --ulysses-degree 4 [Megatron-LM flags...]

Applies :mod:`megatron_patches`, makes ``pretrain`` add ``--ulysses-degree`` to whatever
``extra_args_provider`` the script passes, then runs the script as ``__main__``.
"""

import functools
import os
import runpy
import sys

import megatron_patches


def _chain(provider):
    def extra_args_provider(parser):
        if provider is not None:
            parser = provider(parser) or parser
        return megatron_patches.add_ulysses_args(parser)

    return extra_args_provider


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or not argv[0].endswith(".py"):
        print("usage: python -m megatron_patches.launch /path/to/pretrain_gpt.py [flags...]", file=sys.stderr)
        return 2
    script = argv[0]
    try:
        import megatron.training as mt
    except ImportError as e:
        print(f"error: Megatron-LM's megatron.training is not importable ({e}); put Megatron-LM on PYTHONPATH",
              file=sys.stderr)
        return 2
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    megatron_patches.apply()
    original = mt.pretrain

    @functools.wraps(original)
    def pretrain(*a, extra_args_provider=None, **kw):
        return original(*a, extra_args_provider=_chain(extra_args_provider), **kw)

    mt.pretrain = pretrain
    if hasattr(mt, "training"):
        mt.training.pretrain = pretrain
    sys.argv = argv
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
