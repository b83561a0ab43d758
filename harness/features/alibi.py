"""ALiBi (Press et al., 2022; BLOOM, MPT), ``position_bias=alibi``: head h adds
-slope_h * |i - j| to the logit of query position i for key position j.

nn.MultiheadAttention is handed the bias in its float ``attn_mask`` of (B*H, L, S), exactly, as is
any module that does not apply it itself (its ``position_bias`` attribute says it does). Written
apart from variants/positions.py (the ways' own ALiBi), so that the check compares two
implementations. H heads, L queries, S keys; the queries are the last L of the S positions.
"""

from __future__ import annotations

import math

from harness.features import Feature, computes, shown, torch
from harness.keys import key
from harness.validate import InvalidPoint

KINDS = ("none", "alibi")


def alibi_slopes(H: int) -> list[float]:
    """The paper's slopes: for H a power of two, 2^(-8/H), 2^(-16/H), ..., 2^(-8); otherwise
    those of the largest power of two below H, then every other slope of twice that many heads
    (BLOOM's ``build_alibi_tensor``, MPT's ``gen_slopes``)."""
    if H & (H - 1) == 0:
        return [2 ** (-8 * (h + 1) / H) for h in range(H)]
    low = 2 ** math.floor(math.log2(H))
    return alibi_slopes(low) + alibi_slopes(2 * low)[0::2][: H - low]


def alibi(slopes, queries, keys, dtype=None):
    """(H, L, S) float64: -slope_h * |i - j| for the queries' positions i (L,) and the keys' j
    (S,), on their device; the known mistakes below hand it other slopes or positions.
    ``dtype``: made in float32 (exact distances to 2^24 tokens) and cast to it (a module's
    own: the same value nn.MHA would get from the float64 bias cast, in its dtype's memory)."""
    wide = torch.float64 if dtype in (None, torch.float64) else torch.float32
    distance = (queries.view(-1, 1) - keys.view(1, -1)).abs().to(wide)  # (L, S)
    slope = torch.tensor(slopes, dtype=wide, device=distance.device).view(-1, 1, 1)
    return (-slope * distance).to(dtype or torch.float64)


def _positions(L: int, S: int):
    return torch.arange(S - L, S), torch.arange(S)  # the queries are the last L of S


def position(m, L: int, S: int):
    """The right step: (H, L, S), what each head adds to its logits."""
    return alibi(alibi_slopes(m.H), *_positions(L, S))


class Alibi(Feature):
    keys = {
        "position_bias": key(
            "none",
            "{choices} (alibi: head h adds -slope_h * |i - j| to the logit of query position i "
            "for key position j, slope_h = 2^(-8(h+1)/H) as BLOOM and MPT; nn.MHA is handed it "
            "in a float attn_mask of (B*H, L, S); a module applies it itself when its class "
            "takes position_bias); refused with cross=true",
            role="shape",
            choices=KINDS,
            after="window",
        )
    }
    steps = {"position": ("bias", position)}
    handed = 1
    examples = (  # keys after a query seen, and a decode step
        dict(position_bias="alibi", mask="padding", mode="fwd_bwd"),
        dict(position_bias="alibi", kv_cache_len=9, seq_len=2, num_kv_heads=2),
        dict(position_bias="alibi", sinks=True, mask="causal"),  # BLOOM's shortcut shows here
    )

    def active(self, point) -> bool:
        return point.position_bias != "none"

    def check(self, point, set_) -> None:
        if self.active(point) and point.cross is True:
            raise InvalidPoint(
                f"position_bias={point.position_bias} with cross=true: its distance is between "
                "positions of one sequence (self-attention)"
            )

    def argument(self, point) -> dict:
        return {"position_bias": point.position_bias}

    def term(self, point, model, L: int, S: int, rows=None, like=None):
        if computes(model, "position_bias") or (
            getattr(model, "position_bias", "none") == point.position_bias  # nn.MHA's Math
        ):
            return None  # it adds the bias itself
        device = None if like is None else like.device  # built where it is used (16 GiB in
        queries = torch.arange(S - L, S, device=device)  # float64 on the host at 8k tokens)
        if torch.is_tensor(rows):  # a block's rows (or a slice of them)
            rows = rows.to(queries.device)
        chosen = queries if rows is None else queries[rows]
        keys = torch.arange(S, device=device)
        slopes = alibi_slopes(point.num_heads)
        return alibi(slopes, chosen, keys, None if like is None else like.dtype)  # (H, L, S)

    def case(self, row: dict) -> str:
        kind = shown(row, "position_bias", "none")
        return "" if kind is None else f" {kind}"


FEATURE = Alibi()


def _heads(p) -> bool:
    return FEATURE.active(p) and p.num_heads > 1


@FEATURE.mistake(
    "position",
    "ALiBi's slopes in the reverse head order (head 0 given the smallest)",
    "slope_h = 2^(-8(h+1)/H): head 0 has the largest, 1/2 for H=8",
    _heads,
)
def alibi_slopes_reversed(m, L, S):
    return alibi(alibi_slopes(m.H)[::-1], *_positions(L, S))


@FEATURE.mistake(
    "position",
    "one ALiBi slope for every head (head 0's)",
    "one slope per head, 2^(-8(h+1)/H) for head h (a (H, 1, 1) tensor, not a scalar)",
    _heads,
)
def alibi_slope_shared(m, L, S):
    return alibi([alibi_slopes(m.H)[0]] * m.H, *_positions(L, S))


@FEATURE.mistake(
    "position",
    "ALiBi's bias added with the wrong sign (+slope * distance: far keys favoured)",
    "add -slope_h * |i - j|: the farther the key, the lower its logit",
)
def alibi_sign(m, L, S):
    return -alibi(alibi_slopes(m.H), *_positions(L, S))


@FEATURE.mistake(
    "position",
    "ALiBi omitted (no position bias added)",
    "add -slope_h * |i - j| to head h's scores before the softmax",
)
def alibi_missing(m, L, S):
    return None


@FEATURE.mistake(
    "position",
    "a decode step's query positions counted from 0 (they are P .. P + L - 1, after the cache)",
    "offset the queries by the cache length: i = P + the new token's index",
    lambda p: FEATURE.active(p) and p.kv_cache_len is not None,
)
def alibi_decode_offset(m, L, S):
    return alibi(alibi_slopes(m.H), torch.arange(L), torch.arange(S))


@FEATURE.mistake(
    "position",
    "ALiBi as +slope * j, the key's position only (BLOOM's shortcut, right only under a causal "
    "mask, where the row's -slope * i cancels in the softmax)",
    "-slope_h * |i - j|: keys after the query are as far as keys before it",
)  # tried at every ALiBi point: with sinks it shows under a causal mask too (the sink's column
#    gets no -slope * i), and where it computes the right thing the diagnosis leaves it out
def alibi_key_position_only(m, L, S):
    slopes = torch.tensor(alibi_slopes(m.H), dtype=torch.float64).view(-1, 1, 1)
    return slopes * torch.arange(S, dtype=torch.float64).view(1, 1, S).expand(m.H, L, S)


@FEATURE.mistake(
    "position",
    "ALiBi added to the raw q.k before the 1/sqrt(head_dim) scale, so scaled with them "
    "(Falcon's eager attention)",
    "add -slope_h * |i - j| to the scores after q.k is scaled by 1/sqrt(head_dim)",
    lambda p: FEATURE.active(p) and p.embed_dim // p.num_heads > 1,
)
def alibi_scaled_with_logits(m, L, S):
    return alibi(alibi_slopes(m.H), *_positions(L, S)) / math.sqrt(m.D)
