"""A way at one point before it is timed: what its class declares (capabilities, kernels), its
module built with nn.MHA's weights, its inputs and calls, and its check against the shape's
yardsticks (docs/architecture.md, "Layout")."""
