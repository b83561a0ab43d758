"""variants/adapters.py without a library: ``projection_state`` into every common layout of a
fused or separate projection (a round trip, and the harness finding a wrong layout a
``mismatch``), ``DecoderAttention`` on a plain-PyTorch module that names its heads, its head size
and its cache its own way, and a plain-PyTorch library cache under the ``KVCache`` protocol."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from harness import time_it, verify
from harness.config import InvalidPoint
from harness.way.inputs import tie_groups
from variants.adapters import DecoderAttention, KVCache, PositionCache, projection_state

E, H = 32, 4
LAYOUTS = {
    "separate": dict(qkv=("q", "k", "v"), out="o"),
    "separate transposed": dict(qkv=("q", "k", "v"), out="o", transposed=True),
    "q|k|v blocks": dict(qkv="wqkv", out="proj"),
    "per head": dict(qkv="query_key_value", out="dense", order="heads"),
    "blocks transposed": dict(qkv="c_attn", out="c_proj", transposed=True),
    "per head transposed": dict(qkv="c_attn", out="c_proj", order="heads", transposed=True),
}
# The same shapes read another way: what a module that reads its weights so gets from each.
WRONG = {
    "separate": dict(transposed=True),
    "separate transposed": dict(transposed=False),
    "q|k|v blocks": dict(order="heads"),
    "per head": dict(order="qkv"),
    "blocks transposed": dict(order="heads"),
    "per head transposed": dict(order="qkv"),
}


class Conv1D(nn.Module):
    """GPT-2's kind of projection: the weight (in, out), used as x @ W + b."""

    def __init__(self, n_in: int, n_out: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) * n_in**-0.5)
        self.bias = nn.Parameter(torch.zeros(n_out)) if bias else None

    def forward(self, x):
        y = x @ self.weight
        return y if self.bias is None else y + self.bias


class ToyCache:
    """A plain-PyTorch library's KV cache: ``append`` keeps what it is given (it commits)."""

    def __init__(self):
        self.k = self.v = None

    def append(self, k, v):  # (B, Hkv, L, D) each
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def size(self) -> int:
        return 0 if self.k is None else self.k.size(2)

    def truncate(self, n: int) -> None:
        self.k, self.v = self.k[:, :, :n], self.v[:, :, :n]


class ToyKVCache(KVCache):
    """``ToyCache`` under the harness's protocol: update, length and crop; the rest is KVCache's."""

    def __init__(self, capacity: int):
        super().__init__(capacity, ToyCache())

    def update(self, k, v):
        return self.cache.append(k, v)

    @property
    def length(self) -> int:
        return self.cache.size()

    def crop(self, n: int) -> None:
        self.cache.truncate(n)


class ToyAttention(nn.Module):
    """A plain-PyTorch library's decoder attention reading its projections in ``layout``
    (``projection_state``'s keywords); heads as ``n_heads``/``n_kv``, the head size as ``size``,
    its cache as ``state``, forward(x, attention_mask, state) -> (out, None)."""

    def __init__(self, embed_dim: int, heads: int, kv_heads: int, layout: dict, bias: bool):
        super().__init__()
        self.n_heads, self.n_kv, self.size = heads, kv_heads, embed_dim // heads
        self.qkv, self.order = layout["qkv"], layout.get("order", "qkv")
        self.out = layout["out"]
        transposed = layout.get("transposed", False)

        def make(n_in, n_out):
            return Conv1D(n_in, n_out, bias) if transposed else nn.Linear(n_in, n_out, bias=bias)

        D = self.size
        if isinstance(self.qkv, str):
            setattr(self, self.qkv, make(embed_dim, (heads + 2 * kv_heads) * D))
        else:
            for name, n in zip(self.qkv, (heads, kv_heads, kv_heads)):
                setattr(self, name, make(embed_dim, n * D))
        setattr(self, self.out, make(embed_dim, embed_dim))

    def project(self, x):
        """x (B, L, E) -> q (B, H, L, D), k and v (B, Hkv, L, D)."""
        B, L, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv, self.size
        if not isinstance(self.qkv, str):
            q, k, v = (getattr(self, name)(x) for name in self.qkv)
        elif self.order == "qkv":
            q, k, v = getattr(self, self.qkv)(x).split([H * D, Hkv * D, Hkv * D], dim=-1)
        else:  # per K/V head: its group's query heads, its key, its value
            y = getattr(self, self.qkv)(x).view(B, L, Hkv, H // Hkv + 2, D)
            q, k, v = y[..., :-2, :], y[..., -2, :], y[..., -1, :]
        return (t.reshape(B, L, -1, D).transpose(1, 2) for t in (q, k, v))

    def forward(self, x, attention_mask=None, state=None, **kwargs):
        B, L, E = x.shape
        q, k, v = self.project(x)
        if state is not None:
            k, v = state.append(k, v)
        groups = self.n_heads // self.n_kv
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return getattr(self, self.out)(out.transpose(1, 2).reshape(B, L, E)), None


class ToyMHA(DecoderAttention):
    """``ToyAttention`` behind the variant contract. ``layout``: what the adapter maps nn.MHA's
    weights into; ``reads``: the module's own reading where it differs (a planted mistake);
    ``tell``: whether the adapter is told the heads and head size (the module's names are not
    the ones it looks for); ``fill``: ``module`` (the module writes its cache from the prefix)
    or ``projection`` (``prefix_kv``)."""

    def __init__(
        self,
        embed_dim,
        num_heads,
        bias=True,
        num_kv_heads=None,
        layout="q|k|v blocks",
        reads=None,
        tell=True,
        fill="module",
        cache="state",
    ):
        if bias not in (True, False):
            raise NotImplementedError(f"bias={bias}: one flag for every projection here")
        kv_heads = num_kv_heads or num_heads
        mapped = LAYOUTS[layout]
        attn = ToyAttention(embed_dim, num_heads, kv_heads, {**mapped, **(reads or {})}, bias)
        told = dict(num_heads=attn.n_heads, num_kv_heads=attn.n_kv, head_dim=attn.size)
        super().__init__(
            attn,
            None,
            (bias, bias),
            layout=mapped,
            cache=cache,
            rotary=None,
            prefix_kv=(lambda attn, x: tuple(attn.project(x))[1:])
            if fill == "projection"
            else None,
            **(told if tell else {}),
        )

    def new_cache(self, style, batch, capacity, device, dtype):
        return ToyKVCache(capacity)


TOY = f"{__name__}.ToyMHA"  # importable by its dotted path


def grouped_mha(kv_heads: int, bias: bool = True) -> nn.MultiheadAttention:
    """nn.MHA with nonzero biases, its K/V heads repeated per group (the harness's reference)."""
    mha = nn.MultiheadAttention(E, H, bias=bias, batch_first=True).double()
    with torch.no_grad():
        for p in mha.parameters():
            p.copy_(torch.randn_like(p))
        tie_groups(mha.in_proj_weight, E, H, H // kv_heads)
        if bias:
            tie_groups(mha.in_proj_bias, E, H, H // kv_heads)
    return mha


def read_back(state: dict, layout: dict, kv_heads: int, kind: str) -> torch.Tensor:
    """The module's q, k, v rows of ``kind`` (weight | bias) read back as nn.MHA's (3E, ...),
    each K/V head repeated for its group: the inverse of ``projection_state``."""
    D, G = E // H, H // kv_heads
    flip = layout.get("transposed") and kind == "weight"
    qkv = layout["qkv"]
    if isinstance(qkv, str):
        t = state[f"{qkv}.{kind}"]
        t = t.t() if flip else t
        rest = t.shape[1:]
        if layout.get("order", "qkv") == "qkv":
            q, k, v = t.split([H * D, kv_heads * D, kv_heads * D])
        else:
            per_group = t.reshape(kv_heads, G + 2, D, *rest)
            q, k, v = per_group[:, :G], per_group[:, G], per_group[:, G + 1]
    else:
        q, k, v = (state[f"{name}.{kind}"] for name in qkv)
        q, k, v = (t.t() if flip else t for t in (q, k, v))
        rest = q.shape[1:]
    repeated = [t.reshape(kv_heads, 1, D, *rest).expand(kv_heads, G, D, *rest) for t in (k, v)]
    return torch.cat([q.reshape(E, *rest), *(t.reshape(E, *rest) for t in repeated)])


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kv_heads", [H, 2])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_layout_round_trips(layout, kv_heads, bias):
    """nn.MHA's weights into the layout and read back are nn.MHA's, biases included; the module
    that reads the layout takes them strictly and projects as nn.MHA does."""
    mha = grouped_mha(kv_heads, bias)
    state = dict(mha.state_dict())
    projection_state(state, "", "", H, kv_heads, biases=(bias, bias), **LAYOUTS[layout])
    assert torch.equal(read_back(state, LAYOUTS[layout], kv_heads, "weight"), mha.in_proj_weight)
    out = LAYOUTS[layout]["out"]
    flip = LAYOUTS[layout].get("transposed")
    out_weight = state[f"{out}.weight"].t() if flip else state[f"{out}.weight"]
    assert torch.equal(out_weight, mha.out_proj.weight)
    if bias:
        assert torch.equal(read_back(state, LAYOUTS[layout], kv_heads, "bias"), mha.in_proj_bias)
        assert torch.equal(state[f"{out}.bias"], mha.out_proj.bias)
    module = ToyAttention(E, H, kv_heads, LAYOUTS[layout], bias).double()
    module.load_state_dict(state, strict=True)
    x = torch.randn(2, 5, E, dtype=torch.float64)
    q, k, v = module.project(x)
    wq, wk, wv = mha.in_proj_weight.chunk(3)
    bq, bk, bv = mha.in_proj_bias.chunk(3) if bias else (None, None, None)
    torch.testing.assert_close(q, F.linear(x, wq, bq).view(2, 5, H, -1).transpose(1, 2))
    G = H // kv_heads
    k_ref = F.linear(x, wk, bk).view(2, 5, H, -1).transpose(1, 2)[:, ::G]  # each group's first
    torch.testing.assert_close(k, k_ref)


def test_a_layout_is_differentiable_for_the_checker():
    """The checker maps gradients back through the load hook: every nn.MHA weight gets one."""
    mha = grouped_mha(2)
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in mha.state_dict().items()}
    state = dict(leaves)
    projection_state(state, "", "", H, 2, **LAYOUTS["per head transposed"])
    sum(t.sum() for t in state.values()).backward()
    assert all(t.grad is not None for t in leaves.values())


@pytest.mark.parametrize("kv_heads", [H, 2])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_layout_passes_the_harness_and_a_wrong_one_is_a_mismatch(layout, kv_heads):
    case = dict(embed_dim=E, num_heads=H, num_kv_heads=kv_heads, seq_len=6, batch=2)
    row = verify(TOY, **case, mask="causal", mode="fwd_bwd", variant={"layout": layout})
    assert row["status"] == "ok", row["error"]
    if kv_heads < H and layout.startswith("separate"):
        return  # k and v are (Hkv*D, E): read transposed they do not load (error, not mismatch)
    wrong = verify(TOY, **case, mask="causal", variant={"layout": layout, "reads": WRONG[layout]})
    assert wrong["status"] == "mismatch", wrong


def test_a_missing_bias_must_be_zero():
    state = dict(grouped_mha(H).state_dict())
    with pytest.raises(ValueError, match="c_attn has no bias here"):
        projection_state(state, "", "", H, biases=(False, True), **LAYOUTS["blocks transposed"])
    with pytest.raises(ValueError, match="order='rows' is not one of qkv|heads"):
        projection_state(dict(grouped_mha(H).state_dict()), "", "", H, order="rows")


@pytest.mark.parametrize("fill", ["module", "projection"])
@pytest.mark.parametrize(
    "case",
    [
        dict(seq_len=1, kv_cache="static"),
        dict(seq_len=3, kv_cache="concat", mask="causal"),
        dict(seq_len=2, mask="padding"),
        dict(seq_len=2, mask="sliding", window=4),
    ],
)
def test_a_plain_pytorch_cache_under_the_protocol_decodes(case, fill):
    """The toy library's own cache, wrapped in a KVCache of three members, at decode: the
    prefix written by the module itself or by ``prefix_kv``, two steps checked."""
    row = verify(
        TOY,
        embed_dim=E,
        num_heads=H,
        num_kv_heads=2,
        kv_cache_len=8,
        **case,
        variant={"layout": "per head", "fill": fill},
    )
    assert row["status"] == "ok", row["error"]
    assert row["tensors_checked"] > 1  # step2_* too: what the first step wrote was read back


def test_a_plain_pytorch_cache_is_rewound_before_every_timed_call():
    case = dict(embed_dim=E, num_heads=H, seq_len=1, kv_cache_len=8, kv_cache="concat")
    quick = {"rounds": 3, "round_time": 0.01, "warmup": 0.01}
    row = time_it(TOY, **case, timing=quick)
    assert row["status"] == "ok" and row["latency_ms_median"] > 0, row["error"]
    rewind = ToyKVCache.rewind
    ToyKVCache.rewind = lambda self: None  # as a user who forgot it
    try:
        row = time_it(TOY, **case, timing=quick)
    finally:
        ToyKVCache.rewind = rewind
    assert row["status"] == "mismatch", row


def test_a_missing_assumption_is_one_sentence_naming_the_argument():
    """The toy names its heads ``n_heads``/``n_kv`` and its head size ``size``: not told them,
    the adapter says what to pass; a cache keyword the module does not take is said too."""
    with pytest.raises(ValueError) as raised:
        ToyMHA(E, H, tell=False)
    message = str(raised.value)
    assert "cannot tell the number of query heads" in message and "pass num_heads=" in message
    assert "\n" not in message
    with pytest.raises(InvalidPoint, match="pass num_heads= to DecoderAttention"):
        verify(TOY, embed_dim=E, num_heads=H, variant={"tell": False})
    row = verify(
        TOY, embed_dim=E, num_heads=H, seq_len=1, kv_cache_len=8, variant={"cache": "layer_past"}
    )
    assert (
        row["status"] != "ok"
        and "pass cache= to DecoderAttention" in row["error"]
        and "PositionCache" in row["error"]
    ), row


class PositionalAttention(nn.Module):
    """A library's attention that holds its cache itself, a buffer it writes at the positions it
    is handed (torchtune's and litgpt's way), called ``attn(x, mask=..., input_pos=...)``; the
    mask bool (B|1, 1, L, keys), True where a query may attend."""

    def __init__(self, embed_dim: int, heads: int, bias: bool):
        super().__init__()
        self.heads, self.cache = heads, None
        for name in ("q", "k", "v", "o"):
            setattr(self, name, nn.Linear(embed_dim, embed_dim, bias=bias))

    def setup_cache(self, batch: int, max_len: int, device, dtype) -> None:
        shape = (batch, self.heads, max_len, self.q.out_features // self.heads)
        self.cache = [torch.zeros(shape, device=device, dtype=dtype) for _ in "kv"]

    def forward(self, x, *, mask=None, input_pos=None):
        B, L, E = x.shape
        q, k, v = (
            p(x).view(B, L, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v)
        )
        if input_pos is not None:  # written at its positions; attends to the whole buffer
            self.cache[0][:, :, input_pos], self.cache[1][:, :, input_pos] = k, v
            k, v = self.cache
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o(out.transpose(1, 2).reshape(B, L, E))


class PositionalMHA(DecoderAttention):
    """Its adapter: the call hook and a PositionCache are all it needs beyond the layout."""

    def __init__(self, embed_dim, num_heads, bias=True):
        attn, D = PositionalAttention(embed_dim, num_heads, bias), embed_dim // num_heads
        layout = dict(qkv=("q", "k", "v"), out="o")
        super().__init__(attn, None, (bias, bias), num_heads=num_heads, num_kv_heads=num_heads,
                         head_dim=D, layout=layout, rotary=None)  # fmt: skip

    def new_cache(self, style, batch, capacity, device, dtype):
        self.attn.setup_cache(batch, capacity, device, dtype)
        return PositionCache(capacity)

    def call(self, x, mask, kwargs, kv_cache):
        at = None if kv_cache is None else kv_cache.positions(x.size(1), x.device)
        return self.attn(x, mask=mask > float("-inf"), input_pos=at), None


POSITIONAL_CASES = [
    dict(),
    dict(kv_cache_len=8, seq_len=1),
    dict(kv_cache_len=8, seq_len=2, mask="padding"),
    dict(mode="fwd_bwd", mask="causal"),
]


@pytest.mark.parametrize("case", POSITIONAL_CASES)
def test_a_module_that_writes_its_cache_at_positions_decodes_through_the_call_hook(case):
    row = verify(f"{__name__}.PositionalMHA", embed_dim=E, num_heads=H, **case)
    assert row["status"] == "ok", row["error"]
    if "kv_cache_len" in case:
        assert row["tensors_checked"] > 1  # the second step read what the first wrote
        quick = {"rounds": 3, "round_time": 0.01, "warmup": 0.01}
        timed = time_it(f"{__name__}.PositionalMHA", embed_dim=E, num_heads=H, **case, timing=quick)
        assert timed["status"] == "ok", timed["error"]  # rewound before every timed call


def test_batch_mask_is_nn_mhas_masks_per_sequence():
    from variants.adapters import batch_mask

    B, L, S = 2, 3, 4
    causal = torch.ones(L, S, dtype=torch.bool).triu(1)
    padding = torch.tensor([[False, False, False, True], [False] * 4])
    mask = batch_mask(causal, padding, B, H, L, S, torch.float32)
    assert mask.shape == (B, L, S)
    hidden = causal.unsqueeze(0) | padding.unsqueeze(1)  # (B, L, S)
    assert torch.equal(torch.isinf(mask), hidden) and (mask[~hidden] == 0).all()
    assert batch_mask(None, None, B, H, L, S, torch.float32).eq(0).all()
    per_head = torch.zeros(B * H, L, S, dtype=torch.bool)
    per_head[1, 0, 0] = True  # one head of one sequence differs
    with pytest.raises(ValueError, match="no \\(B, L, S\\) form"):
        batch_mask(per_head, None, B, H, L, S, torch.float32)
