#!/usr/bin/env python3
"""Pretrain a GPT with Megatron-Core and Ulysses sequence parallelism (Megatron-LM's flags).

    torchrun --nproc-per-node 4 examples/pretrain_gpt.py --tensor-model-parallel-size 2 --ulysses-degree 2

The trainer is :mod:`ulysses_mcore.megatron.trainer.pretrain` (``--help`` lists the flags); with no
flags it trains a small GPT on the corpus the package ships, on CPU (gloo) or GPUs (NCCL).
"""

import sys

from ulysses_mcore.megatron.trainer.pretrain import main

if __name__ == "__main__":
    sys.exit(main())
