"""Multi-head latent attention (MLA: DeepSeek-V2 and V3, Kimi K2), ``kv_lora_rank=r``: the keys
and values come from one low-rank latent c_kv shared by the heads, the queries optionally from
one of their own, and each head's query and key carry a few rope channels besides, the key's
shared by every head (the "decoupled" rotary key):

    c_kv = rms(x W_dkv^T) w_kv                      (B, S, r)        kv_a_proj, kv_a_layernorm
    k_h  = [x W_kr^T ; c_kv W_uk,h^T]               (B, S, d_r + d_n) the rope key: every head's
    v_h  = c_kv W_uv,h^T                            (B, S, d_v)       kv_b_proj
    q_h  = c_q W_uq,h^T, c_q = rms(x W_dq^T) w_q    (B, L, d_r + d_n) q_a_proj, q_b_proj
           (or x W_q,h^T where q_lora_rank=0)

A score is q_h . k_h / sqrt(d_r + d_n); rotary embeddings, where on, turn the d_r rope channels
only (``rotary_fraction`` = d_r / head_dim). The "absorbed" decode that serving engines run folds
W_uk,h into the query and W_uv,h into the output and attends to c_kv itself: the same numbers,
which is what the check holds a module to.

nn.MultiheadAttention as the oracle: the heads are head_dim = d_r + d_n wide (embed_dim =
num_heads * head_dim, as nn.MHA has it) and v_h is padded with zeros to head_dim, so that
nn.MHA's attention and scale are MLA's; its out-projection's columns of the padding are zero.
MLA is not linear in x (the latent norms), so no in-projection weight states it: the oracle is
nn.MHA fed these projections through identity in-projections (harness/way/transformed.py), in
float64, the factors its parameters (``kv_down``, ``kv_down_norm``, ``k_up``, ``v_up``,
``k_rope``; ``q_down``, ``q_down_norm``, ``q_up``), drawn per point and handed to a module
through the state dict, so that fwd_bwd compares each factor's gradient by its name. Without
a q latent, the query is nn.MHA's own (its in_proj_weight's query rows). Per head the oracle
holds the rope channels first, [rope; nope] (GPT-NeoX's partial rotary turns the first ones); a
module may order them as it likes (DeepSeek's [nope; rope]): only q . k is compared. Vocabulary:
B batch, H heads, T tokens, D head_dim, d_r rope channels, d_n = D - d_r, d_v the values'.
"""

from __future__ import annotations

from harness.features import Feature, shown, torch
from harness.features.qk_norm import rms, weights
from harness.flops import pairs_seen
from harness.keys import key
from harness.validate import InvalidPoint, number

EPS = 1e-6  # the latent norms' epsilon (DeepSeek-V3's rms_norm_eps)


def spec(point) -> dict:
    """The point's latent attention, as a module's constructor is handed it (``latent=``)."""
    return dict(
        kv_rank=point.kv_lora_rank, q_rank=point.q_lora_rank, rope=point.latent_rope_dim,
        value=point.latent_v_dim, eps=EPS,
    )  # fmt: skip


def shapes(s: dict, E: int, H: int) -> dict:
    """The factors' shapes (nn.Linear's: rows are output channels), by their names."""
    D = E // H
    out = dict(
        kv_down=(s["kv_rank"], E), kv_down_norm=(s["kv_rank"],),
        k_up=(H * (D - s["rope"]), s["kv_rank"]), v_up=(H * s["value"], s["kv_rank"]),
        k_rope=(s["rope"], E),
    )  # fmt: skip
    if s["q_rank"]:
        out.update(q_down=(s["q_rank"], E), q_down_norm=(s["q_rank"],), q_up=(E, s["q_rank"]))
    return out


def linear(x, w):
    return torch.nn.functional.linear(x, w)


def latent(m, x, s: dict, norm: bool = True):
    """c_kv (B, T, r): the latent of the tokens x, normed with ``kv_down_norm`` (``norm``)."""
    c = linear(x, m.kv_down)
    return rms(c[:, None], m.kv_down_norm, s["eps"], "head")[:, 0] if norm else c


def queries(m, query, s: dict, w):
    """(B, L, E): the heads' queries, [rope; nope] each, from the q latent or nn.MHA's rows."""
    if not s["q_rank"]:
        E = query.size(-1)
        return linear(query, m.in_proj_weight[:E] if w is None else w.q)
    c_q = rms(linear(query, m.q_down)[:, None], m.q_down_norm, s["eps"], "head")[:, 0]
    return linear(c_q, m.q_up)


def keys_values(m, key, value, s: dict, k_up=None, v_up=None, rope_heads=None, norm=True):
    """(B, S, E) each: k_h = [rope key; c_kv W_uk,h^T], v_h = [c_kv W_uv,h^T; zeros]. A
    mistake's changes: ``k_up`` (H, d_n, r) and ``v_up`` (H * d_v, r) the up-projections used,
    ``rope_heads`` (H,) bool the heads the rope key is written into, ``norm`` off."""
    B, S, E = key.shape
    H = s["heads"]
    D = E // H
    c_kv = latent(m, key, s, norm)
    c_v = c_kv if value is key else latent(m, value, s, norm)
    up = m.k_up.view(H, D - s["rope"], -1) if k_up is None else k_up
    nope = torch.einsum("bsr,hnr->bshn", c_kv, up)  # (B, S, H, d_n)
    rope = linear(key, m.k_rope)[:, :, None].expand(B, S, H, s["rope"])  # one for every head
    if rope_heads is not None:
        rope = rope * rope_heads.to(rope.dtype).view(1, 1, H, 1)
    k = torch.cat([rope, nope], dim=-1).reshape(B, S, E)
    v = linear(c_v, m.v_up if v_up is None else v_up).view(B, S, H, s["value"])
    return k, torch.nn.functional.pad(v, (0, D - s["value"])).reshape(B, S, E)


def heads_of(m) -> int:
    return m.H if hasattr(m, "H") else m.num_heads  # Math's, or nn.MHA's


def project(m, query, key, value, w=None):
    """The right step (replacing nn.MHA's in-projection): q, k, v (B, T, E) in nn.MHA's layout."""
    s = dict(m.latent, heads=heads_of(m))
    return (queries(m, query, s, w), *keys_values(m, key, value, s))


project.linear = False  # harness/way/scale.py: no in-projection weight states it
project.unreachable = (
    "latent attention normalises its latents: no in-projection weight states its logits, and "
    "the activation-scale pass, which scales input outliers along one, does not apply"
)


class Latent(Feature):
    keys = {
        "kv_lora_rank": key(
            0,
            "r > 0: multi-head latent attention (DeepSeek-V3 512): keys and values "
            "up-projected from one normed latent of r channels (`kv_down`, `kv_down_norm`, "
            "`k_up`, `v_up`) and a rope key shared by the heads (`k_rope`); 0: off; nn.MHA is "
            "fed the projections; a module applies it itself (its class takes latent)",
            role="shape",
            after="qk_norm_eps",  # before rotary's keys: it sets rotary_fraction (``check``)
        ),
        "q_lora_rank": key(
            0, "the queries' latent rank (`q_down`, `q_down_norm`, `q_up`; DeepSeek-V3 1536); "
            "0: nn.MHA's query rows", role="shape", after="kv_lora_rank",
        ),  # fmt: skip
        "latent_rope_dim": key(
            None, "d_r, each head's rope channels of head_dim (null: head_dim / 4, even; "
            "DeepSeek-V3 64 of 192)", role="shape", after="q_lora_rank",
        ),  # fmt: skip
        "latent_v_dim": key(
            None, "d_v, each head's value channels, at most head_dim (null: head_dim; "
            "DeepSeek-V3 128)", role="shape", after="latent_rope_dim",
        ),  # fmt: skip
    }
    steps = {"project": ("project", project)}
    replaces = ("weights", "project")  # nn.MHA's in-projection: the factors project here
    required = True
    needs = (
        "latent attention: a module whose class takes latent and holds its factors "
        "(variants/latent.py; docs/adding.md)"
    )
    examples = (
        dict(kv_lora_rank=4, bias=False, mask="causal", mode="fwd_bwd"),
        dict(kv_lora_rank=3, q_lora_rank=5, latent_v_dim=4, bias=False, rotary="interleaved",
             kv_cache_len=5, seq_len=2),  # fmt: skip
        dict(kv_lora_rank=4, latent_v_dim=4, bias=False, rotary="half", mask="causal",
             mode="fwd_bwd"),  # fmt: skip
    )

    def active(self, point) -> bool:
        return point.kv_lora_rank not in (0, None)

    def check(self, point, set_) -> None:
        others = ("q_lora_rank", "latent_rope_dim", "latent_v_dim")
        number("kv_lora_rank", point.kv_lora_rank, 0, integer=True, unit="a rank >= 0")
        if not self.active(point):
            for name in others:
                if getattr(point, name) not in (None, 0):
                    raise InvalidPoint(f"{name}={getattr(point, name)!r} applies with "
                                       "kv_lora_rank > 0")  # fmt: skip
            return
        D = point.head_dim
        number("q_lora_rank", point.q_lora_rank, 0, integer=True, unit="a rank >= 0")
        if point.latent_rope_dim is None:
            set_("latent_rope_dim", max(2, D // 4 // 2 * 2))
        number("latent_rope_dim", point.latent_rope_dim, 0, above=True, integer=True,
               below=D, unit=f"a positive number of channels below head_dim={D}")  # fmt: skip
        if point.latent_v_dim is None:
            set_("latent_v_dim", D)
        number("latent_v_dim", point.latent_v_dim, 0, above=True, integer=True, below=D + 1,
               unit=f"a positive number of channels, at most head_dim={D}")  # fmt: skip
        for name, bad, why in (
            ("cross", point.cross is True, "the keys and values are one sequence's latent"),
            ("num_kv_heads", point.num_kv_heads not in (None, point.num_heads),
             "its heads share one latent, not grouped K/V heads"),
            ("qk_norm", point.qk_norm != "none", "MLA normalises its latents, not q and k"),
            ("bias", point.in_bias, "its projections have no biases (bias=false or bias=out)"),
        ):  # fmt: skip
            if bad:
                value = getattr(point, name)
                raise InvalidPoint(f"{name}={value} with kv_lora_rank={point.kv_lora_rank}: {why}")
        if point.rotary != "none":  # the rope channels turn, the others do not
            fraction = point.latent_rope_dim / D
            if point.rotary_fraction is None:
                set_("rotary_fraction", fraction)
            elif abs(point.rotary_fraction - fraction) > 1e-9:
                raise InvalidPoint(
                    f"rotary_fraction={point.rotary_fraction:g} with latent_rope_dim="
                    f"{point.latent_rope_dim}: the rope channels turn, {fraction:g} of "
                    f"head_dim={D} (leave rotary_fraction null)"
                )
            if point.latent_rope_dim % 2:
                raise InvalidPoint(
                    f"latent_rope_dim={point.latent_rope_dim} with rotary={point.rotary}: "
                    "rotary turns pairs of channels (an even number)"
                )

    def argument(self, point) -> dict:
        return {"latent": spec(point)}

    def reference(self, point, mha, gen) -> None:
        E, H, D = point.embed_dim, point.num_heads, point.head_dim
        s = spec(point)
        dtype = mha.in_proj_weight.dtype
        for name, shape in shapes(s, E, H).items():
            if len(shape) == 1:  # a norm's weight
                values = weights(shape[0], gen)
            else:  # unit-variance outputs, as nn.MHA's own are drawn (harness/way/inputs.py)
                values = torch.randn(shape, generator=gen, dtype=torch.float64) * shape[1] ** -0.5
            mha.register_parameter(name, torch.nn.Parameter(values.to(dtype)))
        with torch.no_grad():  # what the projection does not read is zero: no gradient, no use
            mha.in_proj_weight[E if not s["q_rank"] else 0 :].zero_()
            mha.out_proj.weight.view(E, H, D)[:, :, s["value"] :].zero_()  # the values' padding

    def work(self, point) -> tuple[float, float | None]:
        """MLA's work in harness/flops.py's conventions, one count for both forms (the naive
        form's FLOPs; the absorbed form trades them for a smaller read): the low-rank
        projections of the L queries and the T = S - P new tokens, scores over head_dim and
        values over d_v per head. A decode step's least bytes read the latent cache, d_r + r per
        token (what the absorbed form reads), not H heads' keys and values: nn.MHA's dense count
        overstated a latent decode's GB/s by 2 E / (d_r + r)."""
        B, L, S = point.batch, point.seq_len, point.kv_seq_len
        E, H = point.embed_dim, point.num_heads
        r, q_rank, d_r, d_v = (point.kv_lora_rank, point.q_lora_rank, point.latent_rope_dim,
                               point.latent_v_dim)  # fmt: skip
        D, P = E // H, point.kv_cache_len or 0
        w_query = 2 * E * q_rank if q_rank else E * E  # q_down and q_up, or nn.MHA's query rows
        w_token = E * r + E * d_r + r * H * (D - d_r) + r * H * d_v  # down, rope key, k_up, v_up
        w_out = H * d_v * E
        proj = 2 * B * (L * (w_query + w_out) + (S - P) * w_token)
        attn = 2 * B * pairs_seen(L, S, point.hides_later_keys, point.window, P) * H * (D + d_v)
        flops = proj + attn if point.mode == "fwd" else proj * (1 + 2) + attn * (1 + 2.5)
        if point.kv_cache_len is None:
            return flops, None
        itemsize = torch.empty(0, dtype=point.torch_dtype).element_size()
        weights = w_query + w_token + w_out + r + q_rank  # with the latent norms' weights
        weights += E if point.out_bias else 0
        cache = B * (P + L) * (d_r + r) + B * L * (d_r + r)  # read, and the new tokens written
        return flops, itemsize * (weights + cache + 2 * B * L * E)

    def case(self, row: dict) -> str:
        rank = shown(row, "kv_lora_rank", 0)
        return "" if rank is None else f" mla=r{int(float(rank))}"


FEATURE = Latent()


@FEATURE.mistake(
    "project",
    "the shared rope key written into the first head only (the other heads' rope channels zero)",
    "broadcast the rope key to every head: k_pe.expand(B, H, S, rope_dim)",
    lambda p: FEATURE.active(p) and p.num_heads > 1,
)
def latent_rope_key_first_head(m, query, key, value, w=None):
    s = dict(m.latent, heads=heads_of(m))
    first = torch.zeros(s["heads"], dtype=torch.bool)
    first[0] = True
    return (queries(m, query, s, w), *keys_values(m, key, value, s, rope_heads=first))


@FEATURE.mistake(
    "project",
    "the rope channels left out of the scores (q_nope . k_nope only)",
    "add q_pe . k_pe to the scores: concatenate the rope channels to q and k, or add both "
    "products in the absorbed form",
)
def latent_rope_dropped(m, query, key, value, w=None):
    s = dict(m.latent, heads=heads_of(m))
    q, k, v = project(m, query, key, value, w)
    B, T, E = q.shape
    keep = torch.ones(E // s["heads"], dtype=q.dtype, device=q.device)
    keep[: s["rope"]] = 0
    return (q.view(B, T, s["heads"], -1) * keep).view(B, T, E), k, v


@FEATURE.mistake(
    "project",
    "the latent not normalised (kv_a_layernorm skipped)",
    "RMS-normalise c_kv with kv_a_layernorm's weight before kv_b_proj",
)
def latent_norm_skipped(m, query, key, value, w=None):
    s = dict(m.latent, heads=heads_of(m))
    return (queries(m, query, s, w), *keys_values(m, key, value, s, norm=False))


@FEATURE.mistake(
    "project",
    "kv_b_proj's rows split as all heads' keys then all heads' values, where they are per head "
    "[k_nope_h; v_h]",
    "view kv_b_proj's output as (B, S, H, nope_dim + v_dim) and split its last dim",
    lambda p: FEATURE.active(p) and p.num_heads > 1,
)
def latent_kv_split_per_projection(m, query, key, value, w=None):
    s = dict(m.latent, heads=heads_of(m))
    H, r = s["heads"], s["kv_rank"]
    n = m.k_up.size(0) // H
    fused = torch.cat([m.k_up.view(H, n, r), m.v_up.view(H, s["value"], r)], dim=1)
    fused = fused.reshape(-1, r)  # kv_b_proj's rows, per head [k_nope_h; v_h]
    k_up, v_up = fused[: H * n].view(H, n, r), fused[H * n :]  # read as [keys; values]
    return (queries(m, query, s, w), *keys_values(m, key, value, s, k_up=k_up, v_up=v_up))


@FEATURE.mistake(
    "project",
    "an absorbed W_UK used untransposed (c_kv's channels read as the key's)",
    "absorb W_UK,h^T into the query: q_lat = q_nope @ W_UK,h (H, nope_dim, kv_lora_rank), "
    "einsum('bhln,hnr->bhlr')",
    lambda p: FEATURE.active(p) and p.head_dim - p.latent_rope_dim == p.kv_lora_rank,
)
def latent_absorbed_untransposed(m, query, key, value, w=None):
    s = dict(m.latent, heads=heads_of(m))
    # (H, r, d_n) read as (H, d_n, r): square here
    k_up = m.k_up.view(s["heads"], -1, s["kv_rank"]).transpose(1, 2)
    return (queries(m, query, s, w), *keys_values(m, key, value, s, k_up=k_up))


@FEATURE.mistake(
    "scale",
    "the scores scaled by 1/sqrt(nope_dim) (the rope channels left out of the softmax scale)",
    "scale by 1/sqrt(qk_nope_head_dim + qk_rope_head_dim), the whole query head",
)
def latent_scale_without_rope(m):
    return (m.D - m.latent["rope"]) ** -0.5
