"""A sliding window, ``mask=sliding window=W`` (Mistral, Gemma's local layers): causal, each query
sees itself and the W - 1 keys before it. nn.MultiheadAttention is handed it as its ``attn_mask``,
aligned bottom-right (the queries are the last L of the S positions), with no ``is_causal`` hint;
a module that builds its own takes ``window`` in its constructor (harness/way/build.py).
"""

from __future__ import annotations

from harness.features import Feature, shown, torch
from harness.keys import key
from harness.validate import InvalidPoint, count, number, with_mask


def hidden(L: int, S: int, W: int, device=None):
    """(L, S) bool, True = may not attend: the queries the last L of S positions, each seeing
    itself and the W - 1 keys before it."""
    position = torch.arange(S - L, S, device=device).view(L, 1)  # each query's place
    keys = torch.arange(S, device=device).view(1, S)
    return (keys > position) | (keys <= position - W)


class Window(Feature):
    keys = {
        "window": key(
            None,
            "W, keys each query sees with mask=sliding (itself included); required by it, "
            "refused without it",
            role="shape",
            after="mask",
        )
    }
    values = {"mask": {"sliding": "causal, each query sees itself and the window-1 keys before it"}}
    examples = (  # a prefill, and a decode step
        dict(mask="sliding", window=3),
        dict(kv_cache_len=5, seq_len=3, mask="sliding", window=2),
    )

    def active(self, point) -> bool:
        return point.mask == "sliding"

    def check(self, point, set_) -> None:
        if not with_mask(point, "window", "sliding", "window=W: the keys each query sees, "
                         "itself included"):  # fmt: skip
            return
        number("window", point.window, 0, above=True, integer=True,
               unit="a positive integer: the keys each query sees with mask=sliding")  # fmt: skip
        if point.cross:
            raise InvalidPoint(
                "mask=sliding with cross=true: a window is over one sequence's positions "
                "(self-attention)"
            )

    def attn_mask(self, point, L: int, S: int):
        mask = hidden(L, S, point.window)  # (L, S)
        return mask if mask.any() else None  # one new token whose window holds every key

    def rows(self, point) -> set:
        return {point.window - 1, point.window}  # where the window fills, and the row after

    def case(self, row: dict) -> str:
        W = shown(row, "window")
        return "" if W is None else f" W={count(W)}"


FEATURE = Window()


def _wider(delta: int):
    def fn(m, attn_mask, key_padding_mask, L, S):
        wrong = hidden(L, S, m.point.window + delta, m.device)
        return m.right("mask")(m, wrong, key_padding_mask, L, S)

    return fn


FEATURE.mistake(
    "mask",
    "a window one key too wide (each query sees window + 1 keys: < written for <=)",
    "a query at position i sees keys i - window + 1 .. i: hide keys <= i - window",
    name="window_one_wide",
)(_wider(1))
FEATURE.mistake(
    "mask",
    "a window one key too narrow (each query sees window - 1 keys)",
    "a query at position i sees keys i - window + 1 .. i: hide keys <= i - window, no more",
    lambda p: FEATURE.active(p) and (p.window or 0) > 1,
    name="window_one_narrow",
)(_wider(-1))
