"""Run Megatron-LM's pretrain_gpt.py (or any script built on megatron.training) with Ulysses.

    torchrun --nproc-per-node 8 -m megatron_patches.launch /path/to/Megatron-LM/pretrain_gpt.py \
        --ulysses-degree 4 [Megatron-LM flags...]

What it does before running the script, unchanged, as ``__main__``:

* sets ``CUDA_DEVICE_MAX_CONNECTIONS=1`` when it is unset (Megatron-LM requires it with
  context parallelism, which ``--ulysses-degree`` is folded into, before Blackwell), except with
  ``--use-torch-fsdp2`` / ``--use-megatron-fsdp`` (Megatron-LM's FSDP refuses it);
* without CUDA only: :func:`ulysses_mcore.megatron.compat.cpu_compat.apply_megatron_lm` (the CPU
  adaptations of megatron.core and megatron.training; nothing on a GPU node);
* :func:`megatron_patches.apply` (``--ulysses-degree`` folded into context parallelism, the
  layout recorded, ``UlyssesAttention`` in megatron-core's GPT layer specs);
* adds ``--ulysses-degree`` / ``--ulysses-attention-backend`` to Megatron-LM's parser, for
  both argument entry points (``pretrain(extra_args_provider=...)`` up to megatron-core
  0.16, ``parse_and_validate_args`` from 0.19 on): every ``parse_args`` binding chains them
  after the script's own ``extra_args_provider``.
"""

import functools
import importlib
import os
import runpy
import sys

USAGE = "usage: python -m megatron_patches.launch /path/to/pretrain_gpt.py [Megatron-LM flags...]"


def _chain(provider):
    import megatron_patches

    def extra_args_provider(parser):
        if provider is not None:
            parser = provider(parser) or parser
        return megatron_patches.add_ulysses_args(parser)

    return extra_args_provider


def _wrap_parse_args(fn):
    @functools.wraps(fn)
    def parse_args(extra_args_provider=None, *a, **kw):
        return fn(_chain(extra_args_provider), *a, **kw)

    parse_args._ulysses = True
    return parse_args


def add_flags_to_megatron_lm_parser():
    """Rebind ``megatron.training.arguments.parse_args`` (and its by-name imports) so the
    parser Megatron-LM builds knows ``--ulysses-degree``."""
    args_mod = importlib.import_module("megatron.training.arguments")
    original = args_mod.parse_args
    if getattr(original, "_ulysses", False):
        return
    wrapped = _wrap_parse_args(original)
    for name, mod in list(sys.modules.items()):
        if (name.startswith("megatron.training") or name.startswith("megatron.post_training")) and getattr(
            mod, "parse_args", None
        ) is original:
            mod.parse_args = wrapped


def _import_megatron_lm():
    """Import megatron.training; on failure return the message for the user."""
    try:
        importlib.import_module("megatron.training.training")
        importlib.import_module("megatron.training.arguments")
        importlib.import_module("megatron.training.initialize")
    except ModuleNotFoundError as e:
        if e.name in ("megatron", "megatron.training"):
            return (
                "Megatron-LM's megatron.training is not importable: put Megatron-LM's folder on PYTHONPATH "
                "(megatron-core >= 0.19 ships it in the wheel)"
            )
        return (
            f"Megatron-LM's megatron.training needs the module {e.name!r}, which is not installed: "
            f"pip install 'ulysses-mcore[megatron-lm]' (six, regex, pyyaml, triton)"
        )
    except ImportError as e:
        return f"Megatron-LM's megatron.training is not importable ({e})"
    return None


def _degrees(argv):
    """The parallel degrees on the command line (a tolerant pre-parse; Megatron-LM checks them)."""
    import argparse

    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag in ("--ulysses-degree", "--context-parallel-size", "--tensor-model-parallel-size"):
        p.add_argument(flag, type=int, default=1)
    try:
        ns, _ = p.parse_known_args(argv)
    except SystemExit:  # a malformed value: Megatron-LM's own parser will say so
        return 1, 1, 1
    return ns.ulysses_degree, ns.context_parallel_size, ns.tensor_model_parallel_size


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or not argv[0].endswith(".py"):
        print(USAGE, file=sys.stderr)
        return 2
    script = argv[0]
    if not os.path.isfile(script):
        print(f"error: {script}: no such script. {USAGE}", file=sys.stderr)
        return 2
    fsdp = any(flag in argv for flag in ("--use-torch-fsdp2", "--use-megatron-fsdp"))
    if max(_degrees(argv[1:])) > 1 and not fsdp:  # Megatron-LM: FSDP refuses a single connection
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    problem = _import_megatron_lm()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    import torch

    import megatron_patches

    if not torch.cuda.is_available():
        from ulysses_mcore.megatron.compat import cpu_compat

        cpu_compat.apply_megatron_lm()
    megatron_patches.apply()
    add_flags_to_megatron_lm_parser()
    sys.argv = argv
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
