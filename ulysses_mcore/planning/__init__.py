"""Planning: arithmetic over a layout, a model config and sequence lengths -- no torch, no Megatron.

* :mod:`.memory_model`: per-rank memory and all-to-all bytes, the longest sequence in a budget;
* :mod:`.shape`: the model's shape, and the FLOPs and exchanged elements of a layer (counted once);
* :mod:`.step_time`: the layouts a world can run and a phase-by-phase step-time model, fitted to
  measured sweeps over several lengths or taken from datasheet presets;
* :mod:`.calibration`: a fitted model's rates and what they were fitted on (``--calibration``);
* :mod:`.placement`: ``--dynamic-ulysses``' placement of documents on the same model's costs.
"""
