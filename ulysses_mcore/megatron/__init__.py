"""The Megatron-Core adapter, in three rooms (each imports only the rooms above it in this list):

* :mod:`~ulysses_mcore.megatron.layer` -- what goes inside a Megatron model: ``UlyssesAttention``
  (the ``core_attention`` slot), the layer specs that put it there, the process groups, batch
  sharding, the memory features of a layer, RoPE after the exchange;
* :mod:`~ulysses_mcore.megatron.compat` -- Megatron as it is installed: the Megatron-LM patches
  (``--ulysses-degree`` for Megatron-LM's own ``pretrain_gpt.py``), the CPU shims, the fake-CUDA
  stand-ins of the dry run;
* :mod:`~ulysses_mcore.megatron.trainer` -- this package's Megatron trainer: flags, the training
  loop, model building, data, loss, checkpoints, timing, ``--dynamic-ulysses``, the dry run.
"""
