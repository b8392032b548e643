"""Planning: arithmetic over a layout, a model config and sequence lengths -- no torch, no Megatron.

* :mod:`.memory_model`: per-rank memory and all-to-all bytes, the longest sequence in a budget;
* :mod:`.step_time`: the layouts a world can run and a phase-by-phase step-time model, fitted to
  measured sweeps or taken from datasheet presets.
"""
