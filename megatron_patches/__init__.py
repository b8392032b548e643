"""Ulysses for Megatron-LM's own ``pretrain_gpt.py``, with no edit to Megatron-LM: the thin
entry point.  Run the script through the launcher::

    torchrun --nproc-per-node 8 -m megatron_patches.launch /path/to/Megatron-LM/pretrain_gpt.py \
        --ulysses-degree 4 --tensor-model-parallel-size 2 ... (Megatron-LM's usual flags)

or call :func:`apply` in your own copy of the script.  What the patches do, and the code, is
:mod:`ulysses_mcore.megatron.compat.patches` (the Megatron adapter).
"""

from ulysses_mcore.megatron.compat.patches import (  # noqa: F401
    SPEC_FUNCTIONS,
    add_ulysses_args,
    apply,
    fold_args,
    is_applied,
    remove,
)

__all__ = ["SPEC_FUNCTIONS", "add_ulysses_args", "apply", "fold_args", "is_applied", "remove"]
