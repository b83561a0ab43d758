"""The ways and points a model's key (position_bias, sinks, ...) is checked across, shared by its
tests: each structure and kernel at least once, with the masks (bool and additive), a window,
grouped heads, a decode step in bfloat16 and fwd_bwd with the weights."""

ACROSS = [
    ("fused", dict(mask="causal")),
    ("fused", dict(mask="padding", variant={"attention": "manual"})),
    ("separate", dict(mask="sliding", window=4, mode="fwd_bwd", need_weights=True)),
    ("packed", dict(kv_cache_len=9, seq_len=2, num_kv_heads=2, dtype="bfloat16")),
    ("fused", dict(mask="padding", mask_format="additive", num_kv_heads=3, mode="fwd_bwd")),
]
