"""QK-norm (Qwen3, Gemma 3, OLMo 2), ``qk_norm=head|whole``: the queries and keys RMS-normalised
after the projections, before the rotary embeddings, each with a learned weight: ``head`` over each
head's D channels with one weight (D,) shared by the heads (Qwen3's and Gemma 3's ``q_norm`` and
``k_norm``), ``whole`` over the whole projection's E channels with a weight (E,) (OLMo 2's).

    x -> x / sqrt(mean(x^2) + eps) * w      (in float32 or wider, as the models compute it)

nn.MultiheadAttention cannot normalise what it projects: the oracle is nn.MHA fed the normed
projections (harness/way/transformed.py, whose ``qk`` steps these are, before rotary's: this
module's keys stand before rotary's in the config, and the features' steps run in that order).
The two weights are parameters ``q_norm`` and ``k_norm`` of that nn.MHA (``reference``), drawn
per point and handed to the module through the state dict; fwd_bwd compares their gradients
(``grad_q_norm``, ``grad_k_norm``) like a weight's. A norm bounds the logits (|q . k| / sqrt(D)
<= sqrt(D) max|w|^2), so the activation-scale pass, which scales input outliers to reach a large
logit, does not apply (harness/way/scale.py says so). Gemma's RMSNorm multiplies by (1 + w): its
adapter hands w - 1. Vocabulary: B batch, H heads, T tokens, D head_dim, E = H * D.
"""

from __future__ import annotations

from harness.features import Feature, shown, torch
from harness.keys import key
from harness.validate import InvalidPoint, number

OVER = ("none", "head", "whole")
EPS = 1e-6  # what a null qk_norm_eps reads as (Qwen3's, Gemma 3's; OLMo 2: 1e-6 too)


def spec(point) -> dict:
    """The point's QK-norm, as a module's constructor is handed it (``qk_norm=``)."""
    return dict(over=point.qk_norm, eps=point.qk_norm_eps)


def weights(size: int, gen):
    """(size,) float64: learned norm weights, spread over 0.3 .. 2 in a seeded order (a norm
    done with a wrong weight, or over the wrong channels, then shows)."""
    spread = torch.linspace(0.3, 2.0, size, dtype=torch.float64)
    return spread[torch.randperm(size, generator=gen)]


def rms(x, weight, eps: float, over: str):
    """x (B, H, T, D) normed ``over`` each head or the whole projection (H * D channels, the
    heads of one token together), times ``weight``; in float32 for a narrower x, as the models
    compute it, then cast back."""
    wide = x.dtype if x.dtype == torch.float64 else torch.float32
    B, H, T, D = x.shape
    if over == "head" and weight.numel() == H * D:  # a whole projection's weight, per head
        weight = weight.view(H, 1, D)
    elif over == "whole" and weight.numel() == D:  # one head's weight over the whole projection
        weight = weight.repeat(H)
    y = x.to(wide)
    if over == "whole":
        y = y.transpose(1, 2).reshape(B, T, H * D)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * weight.to(wide)
    if over == "whole":
        y = y.view(B, T, H, D).transpose(1, 2)
    return y.to(x.dtype)


def qk_norm(m, q, k, v, qpos, kpos):
    """The right step: q and k normed with their weights (``m.q_norm``, ``m.k_norm``)."""
    s = m.qk_norm
    return rms(q, m.q_norm, s["eps"], s["over"]), rms(k, m.k_norm, s["eps"], s["over"]), v


qk_norm.linear = False  # harness/way/scale.py: a step that bounds the logits
qk_norm.unreachable = (
    "QK-norm bounds the logits (|q.k| / sqrt(D) <= sqrt(D) max|w|^2): no outlier factor reaches "
    "a large logit at this point"
)


class QKNorm(Feature):
    keys = {
        "qk_norm": key(
            "none",
            "{choices}: QK-norm, q and k RMS-normalised after the projections (before rotary) "
            "with learned weights `q_norm`, `k_norm`: head, over each head with one (head_dim,) "
            "weight (Qwen3, Gemma 3); whole, over the whole projection with an (embed_dim,) "
            "weight (OLMo 2); nn.MHA is fed the normed projections; a module applies it itself "
            "(its class takes qk_norm)",
            role="shape",
            choices=OVER,
            after="sinks",
        ),
        "qk_norm_eps": key(
            None, "the norm's epsilon (null: 1e-6)", role="shape", after="qk_norm",
        ),  # fmt: skip
    }
    steps = {"qk_norm": ("qk", qk_norm)}
    required = True
    needs = "QK-norm: parameters `q_norm` and `k_norm`; docs/adding.md says how a module takes them"
    examples = (
        dict(qk_norm="head", mask="causal", mode="fwd_bwd"),
        dict(qk_norm="whole", rotary="half", kv_cache_len=5, seq_len=2),
        dict(qk_norm="head", rotary="interleaved", rotary_scaling="yarn", rotary_factor=4.0,
             rotary_original=8, mask="causal", mode="fwd_bwd"),  # fmt: skip
    )

    def active(self, point) -> bool:
        return point.qk_norm != "none"

    def check(self, point, set_) -> None:
        if not self.active(point):
            if point.qk_norm_eps is not None:
                raise InvalidPoint(
                    f"qk_norm_eps={point.qk_norm_eps!r} applies with qk_norm=head|whole"
                )
            return
        if point.qk_norm_eps is None:
            set_("qk_norm_eps", EPS)
        number("qk_norm_eps", point.qk_norm_eps, 0, above=True, below=1,
               unit="a small positive number")  # fmt: skip
        if point.qk_norm == "whole" and point.num_kv_heads not in (None, point.num_heads):
            raise InvalidPoint(
                f"qk_norm=whole with num_kv_heads={point.num_kv_heads}: a whole-projection norm "
                "of fewer K/V heads has no nn.MHA form here (nn.MHA holds them repeated)"
            )

    def argument(self, point) -> dict:
        return {"qk_norm": spec(point)}

    def reference(self, point, mha, gen) -> None:
        size = point.head_dim if point.qk_norm == "head" else point.embed_dim
        for name in ("q_norm", "k_norm"):
            values = weights(size, gen).to(mha.in_proj_weight.dtype)
            mha.register_parameter(name, torch.nn.Parameter(values))

    def case(self, row: dict) -> str:
        over = shown(row, "qk_norm", "none")
        return "" if over is None else f" qk_norm={over}"


FEATURE = QKNorm()


@FEATURE.mistake(
    "qk_norm",
    "QK-norm over the wrong channels (the whole projection where it is per head, or the reverse)",
    "normalise each head's head_dim channels (Qwen3, Gemma 3) or the whole projection (OLMo 2), "
    "as the model's q_norm weight's size says",
)
def qk_norm_wrong_axis(m, q, k, v, qpos, kpos):
    s = m.qk_norm
    other = "whole" if s["over"] == "head" else "head"  # the same weights, channel by channel
    return rms(q, m.q_norm, s["eps"], other), rms(k, m.k_norm, s["eps"], other), v


@FEATURE.mistake(
    "qk_norm",
    "QK-norm applied after the rotary embeddings",
    "normalise q and k right after the projections, then rotate them",
    lambda p: FEATURE.active(p) and p.rotary != "none",
)
def qk_norm_after_rotary(m, q, k, v, qpos, kpos):
    # rotary's step runs after this one: hand it what turns into norm(rotate(x)), i.e.
    # rotate^-1(norm(rotate(x))) (a rotation scaled by a, inverted by the transpose over a^2)
    from harness.features.rotary import angles, turn

    s, r = m.qk_norm, m.rotary
    D = q.size(-1)

    def there_and_back(x, w, positions):
        cos, sin = angles(r, D, positions, None if x.dtype == torch.float64 else torch.float32)
        a2 = cos.pow(2) + sin.pow(2)  # the attention factor squared, per position and pair
        y = rms(turn(x, cos, sin, r["layout"]), w, s["eps"], s["over"])
        return turn(y, cos / a2, -sin / a2, r["layout"])

    return there_and_back(q, m.q_norm, qpos), there_and_back(k, m.k_norm, kpos), v


@FEATURE.mistake(
    "qk_norm",
    "the norm's weight read as Gemma's (1 + w) where it is w, or the reverse",
    "multiply by the weight as the model's RMSNorm does: Gemma's by (1 + w), Qwen3's by w",
)
def qk_norm_weight_offset(m, q, k, v, qpos, kpos):
    s = m.qk_norm
    return (rms(q, 1 + m.q_norm, s["eps"], s["over"]), rms(k, 1 + m.k_norm, s["eps"], s["over"]),
            v)  # fmt: skip


@FEATURE.mistake(
    "qk_norm",
    "the keys not normalised (the queries only)",
    "normalise the keys with k_norm as the queries with q_norm",
)
def qk_norm_queries_only(m, q, k, v, qpos, kpos):
    s = m.qk_norm
    return rms(q, m.q_norm, s["eps"], s["over"]), k, v


@FEATURE.mistake(
    "qk_norm",
    "the query norm's weight used for the keys too (k_norm not loaded)",
    "load k_norm's own weight for the keys",
)
def qk_norm_shared_weight(m, q, k, v, qpos, kpos):
    s = m.qk_norm
    return rms(q, m.q_norm, s["eps"], s["over"]), rms(k, m.q_norm, s["eps"], s["over"]), v
