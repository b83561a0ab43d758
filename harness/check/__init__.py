"""The check stage: which tensors are compared with nn.MultiheadAttention's (``collect``, with
gradients mapped to nn.MHA's parameter names) and the tolerance rule (``checks``)."""
