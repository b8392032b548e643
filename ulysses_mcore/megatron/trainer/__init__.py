"""This package's Megatron trainer: flags, loop, model, data, loss, checkpoints, timing,
--dynamic-ulysses, the dry run."""
