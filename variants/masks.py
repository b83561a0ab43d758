"""nn.MultiheadAttention's masks, as every kernel receives them (``Masks``).

nn.MHA's conventions: a bool mask's True means "may not attend" (the opposite of SDPA's bool
convention); a float mask is added to the scores; ``attn_mask`` is (L, S) or (B*H, L, S) and
``key_padding_mask`` (B, S). Vocabulary: B batch, H heads, L query length, S key length.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from harness.way.scale import merge_masks  # noqa: F401 (the kernels' and examples' import)
from variants.positions import alibi


_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)


def top_left(L: int, S: int, device) -> torch.Tensor:
    """(L, S) bool, True above the diagonal: a top-left causal mask in nn.MHA's convention."""
    return torch.ones(L, S, dtype=torch.bool, device=device).triu(1)


class Masks(NamedTuple):
    """What a kernel is asked to mask, decided once by the variant's forward.

    ``causal``: apply a top-left causal mask yourself (nn.MHA's ``is_causal`` hint, trusted only
    when nothing else has to be merged in); ``attn_mask`` is then None. Otherwise the masks are
    as nn.MHA got them. ``merged`` gives both as one additive mask; ``cached`` builds a derived
    mask once per mask and shape, outside the timed call. A NamedTuple: torch.compile traces it.
    """

    attn_mask: torch.Tensor | None
    key_padding_mask: torch.Tensor | None
    causal: bool
    B: int
    H: int
    L: int
    S: int
    cache: Callable  # the module's ``cached(name, masks, extra, build)``
    # ALiBi's slope per query head (variants/positions.py), or None: no position bias. Kernels
    # that take additive masks get it in ``merged``; FlexAttention adds it in its score_mod.
    slopes: tuple | None = None
    # Attention sinks: (H,) logits, one per query head, each joining every query's softmax as
    # a column dropped after it (its value is zero), or None. A parameter: never cached.
    sinks: torch.Tensor | None = None

    def merged(self, dtype: torch.dtype, device=None) -> torch.Tensor | None:
        """attn_mask + key_padding_mask + the position bias, additive, broadcastable to
        (B, H, L, S); None if none of them. ``device``: the bias's (else the masks')."""
        mask = None
        if self.attn_mask is not None or self.key_padding_mask is not None:
            mask = merge_masks(
                self.attn_mask, self.key_padding_mask, self.B, self.H, self.L, self.S, dtype
            )
        if self.slopes is None:
            return mask
        where = device if device is not None else mask.device
        bias = alibi(self.slopes, self.L, self.S, where).to(dtype)  # (1, H, L, S)
        return bias if mask is None else mask + bias

    def sink_column(self, dtype: torch.dtype) -> torch.Tensor:
        """(1, H, 1, 1): the sink logits in ``dtype``, to append to (B, H, L, S) scores."""
        return self.sinks.to(dtype).view(1, -1, 1, 1)

    def once(self, name: str, build: Callable, *extra):
        """``build()`` once per mask and shape in eager mode, outside the timed calls (a window's
        dense (L, S) mask turned additive on every call made "window vs causal" a comparison of
        mask formats); under torch.compile inline, where the compiler fuses it into the kernel."""
        if _compiling():
            return build()
        return self.cached(name, build, *extra)

    def cached(self, name: str, build: Callable, *extra):
        """``build()`` once for these mask tensors, this shape and ``extra`` (dtype, device...)."""
        return self.cache(
            name,
            (self.attn_mask, self.key_padding_mask),
            (self.causal, self.B, self.H, self.L, self.S, *extra),
            build,
        )
