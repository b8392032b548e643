"""Megatron-Core glue: process groups, layer specs, batch sharding, loss."""
