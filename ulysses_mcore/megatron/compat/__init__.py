"""Megatron as installed: the Megatron-LM patches, the CPU shims, the fake-CUDA stand-ins of the dry run."""
