"""A library's attention sinks and ALiBi behind the variant contract (docs/guide.md, "Checking a
decoder's attention from a library").

- ``sinks_state``: nn.MHA's sinks (H,) (harness/features/sinks.py) moved onto the library's own
  parameter, whatever its name and shape, in its head order.
- ``LibraryAlibi``: the ALiBi argument of a module whose forward takes the bias as a tensor
  (BLOOM's ``alibi``, Falcon's ``alibi``, MPT's ``position_bias``). Who applies ALiBi follows
  one rule (docs/adding.md, "Grouped heads, a KV cache, a window (optional)"): a class that
  takes ``position_bias`` is handed it and applies it itself, so the adapter builds the
  library's own bias and the library's code is checked; a class that does not is handed nn.MHA's
  bias inside ``attn_mask``, so the adapter hands the library zeros of the same shape.

Vocabulary: B batch, S keys, H query heads.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def sinks_state(
    state_dict: dict,
    prefix: str,
    into: str,
    module: nn.Module,
    name: str = "sinks",
    heads=None,
) -> None:
    """nn.MHA's ``{prefix}sinks`` (H,) moved, in place, to ``{into}{name}``: ``name`` is the
    library's parameter (or buffer) in ``module``, a dotted path, in its own shape ((H,),
    (1, H, 1, 1), (Hkv, G): head h at flat index h). ``heads``: where the library keeps its sinks in
    another order than its query heads, nn.MHA's head for each of its slots (a list of H indices).
    ValueError naming the module's parameters where ``name`` is not one of them, or where its
    size is not H. Plain tensor ops: the checker maps the gradient back (``grad_sinks``)."""
    if prefix + "sinks" not in state_dict:
        return
    sinks = state_dict.pop(prefix + "sinks")  # (H,)
    try:
        target = module.get_parameter(name)
    except AttributeError:
        try:
            target = module.get_buffer(name)
        except AttributeError:
            held = ", ".join(n for n, _ in module.named_parameters()) or "none"
            raise ValueError(
                f"{type(module).__name__} has no parameter {name!r} for the attention sinks "
                f"(its parameters: {held}); pass sinks='<its name>' to DecoderAttention.__init__"
            ) from None
    if target.numel() != sinks.numel():
        raise ValueError(
            f"{type(module).__name__}.{name} has {target.numel()} values ({tuple(target.shape)}); "
            f"the point's sinks are one per query head, {sinks.numel()}"
        )
    if heads is not None:
        sinks = sinks[torch.as_tensor(heads, device=sinks.device)]
    state_dict[into + name] = sinks.reshape(target.shape)


class LibraryAlibi:
    """The library's ALiBi tensor for a call with B sequences of S keys, made once per shape,
    dtype and device outside the timed call. ``build(B, S, dtype, device)`` calls the library's
    own function (BLOOM's ``build_alibi_tensor(torch.ones(B, S), H, dtype)``). ``position_bias``:
    what the adapter's class was handed ("alibi": the library's bias; "none", or a class that
    takes no ``position_bias``: zeros of its shape, as the harness's bias is in the mask)."""

    def __init__(self, build, position_bias: str = "none"):
        self.build, self.own = build, position_bias == "alibi"
        self.key, self.bias = None, None

    def __call__(self, B: int, S: int, dtype: torch.dtype, device) -> torch.Tensor:
        key = (B, S, dtype, str(device))
        if key != self.key:
            bias = self.build(B, S, dtype, device)
            self.key, self.bias = key, bias if self.own else torch.zeros_like(bias)
        return self.bias
