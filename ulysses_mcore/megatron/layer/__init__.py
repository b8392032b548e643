"""What goes inside a Megatron model: the attention module, its layer specs, its groups, batch
sharding, a layer's memory features, RoPE after the exchange."""
