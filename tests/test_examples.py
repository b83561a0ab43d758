"""The adapters in examples/ (timm's ViT Attention, transformers' BERT self-attention) against
nn.MultiheadAttention, directly and through the CLI; each is skipped where its library does not
import. Float64 so that any difference is a bug; biases randomised (nn.MHA zero-initialises them).
"""

from __future__ import annotations

import functools
import importlib
import itertools

import pandas as pd
import pytest
import torch
import torch.nn as nn

from harness.way.compared import map_grads
from harness.declarations import parse_declaration
from tests.conftest import REPO, TINY

B, L, E, H = 2, 5, 16, 2

# what to do about it: docs/guide.md, "Outside variants and checking a library's attention" says
# more
HINTS = {
    "timm_vit": "timm imports torchvision, whose registry wheel needs the torch build it was made "
    "for: install the torchvision that matches your torch, or none (docs/guide.md)",
    "hf_bert": "install transformers beside torch: bash scripts/install-beside-torch.sh "
    "transformers; an installed torchvision that does not match torch breaks its import too "
    "(docs/guide.md)",
}
ADAPTERS = {
    "timm_vit": ("examples.timm_vit", "TimmViTAttention", "timm_attention"),
    "hf_bert": ("examples.hf_bert", "BertSelfAttentionMHA", "bert_classes"),
}


@functools.cache
def _load(name: str):
    """(the adapter class, None) or (None, why it cannot be imported here). Any exception counts,
    not only ImportError: a torchvision built for another torch raises RuntimeError at import."""
    module, cls, library = ADAPTERS[name]
    module = importlib.import_module(
        module
    )  # the adapter itself always imports: it imports its library lazily
    try:
        getattr(module, library)()
    except NotImplementedError as e:
        return None, f"{name}: {e}; {HINTS[name]}"
    return getattr(module, cls), None


def load(name: str):
    """The adapter class, or skip the test with the reason. Imported when a test runs, not at
    collection: these libraries take seconds to import."""
    cls, why = _load(name)
    if cls is None:
        pytest.skip(why)
    return cls


CONFIGS = [
    pytest.param("timm_vit", {}, id="timm_vit"),
    pytest.param("hf_bert", {"attn_implementation": "sdpa"}, id="hf_bert-sdpa"),
    pytest.param("hf_bert", {"attn_implementation": "eager"}, id="hf_bert-eager"),
]


def reference(bias: bool = True) -> nn.MultiheadAttention:
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, bias=bias, batch_first=True).double()
    with torch.no_grad():
        for p in ref.parameters():  # nn.MHA's zero biases would hide a bias bug
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() == 1 else E**-0.5))
    return ref


def masks(mask: str, fmt: str) -> dict:
    """forward() keywords for a mask, as the harness passes them (harness/way/inputs.py)."""
    kw: dict = {}
    if mask == "causal":
        kw = {"attn_mask": torch.ones(L, L, dtype=torch.bool).triu(1), "is_causal": True}  # (L, S)
    elif mask == "padding":
        kw = {
            "key_padding_mask": torch.tensor(
                [[False] * (L - 1) + [True], [False] * (L - 2) + [True] * 2]
            )
        }
    if fmt == "additive":
        kw = {
            k: torch.zeros(v.shape, dtype=torch.float64).masked_fill(v, float("-inf"))
            if k != "is_causal"
            else v
            for k, v in kw.items()
        }
    return kw


def run(model, x, grad_out, **kw):
    """out, weights and the input's gradient of one forward + backward (x as query, key and
    value)."""
    x = x.clone().requires_grad_(True)
    model.zero_grad(set_to_none=True)
    out, weights = model(x, x, x, **kw)
    out.backward(grad_out)
    return out.detach(), weights, x.grad


@pytest.mark.parametrize(
    "mask,fmt", [("none", "bool"), *itertools.product(("causal", "padding"), ("bool", "additive"))]
)
@pytest.mark.parametrize("name,options", CONFIGS)
def test_adapter_matches_nn_mha_in_float64(name, options, mask, fmt):
    cls = load(name)
    ref = reference()
    model = cls(embed_dim=E, num_heads=H, bias=True, **options).double()
    model.load_state_dict(ref.state_dict(), strict=True)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, L, E, generator=g, dtype=torch.float64)
    grad_out = torch.randn(B, L, E, generator=g, dtype=torch.float64)
    kw = masks(mask, fmt)
    want_out, _, want_grad = run(ref, x, grad_out, need_weights=False, **kw)
    want_params = {f"grad_{n}": p.grad for n, p in ref.named_parameters()}
    got_out, got_weights, got_grad = run(model, x, grad_out, need_weights=False, **kw)
    assert got_weights is None
    torch.testing.assert_close(got_out, want_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=1e-12)
    # the adapter's parameter gradients, mapped back to nn.MHA's names through its load hook
    got_params = map_grads(model, ref.state_dict())
    assert set(got_params) == set(want_params)
    for param, want in want_params.items():
        torch.testing.assert_close(got_params[param], want, rtol=0, atol=1e-12, msg=param)


@pytest.mark.parametrize("average", [True, False])
def test_bert_eager_returns_nn_mha_weights(average):
    cls, options = load("hf_bert"), {"attn_implementation": "eager"}
    ref = reference()
    model = cls(embed_dim=E, num_heads=H, **options).double()
    model.load_state_dict(ref.state_dict())
    x = torch.randn(B, L, E, dtype=torch.float64)
    for kw in (masks("none", "bool"), masks("causal", "bool"), masks("padding", "additive")):
        want = ref(x, x, x, need_weights=True, average_attn_weights=average, **kw)
        got = model(x, x, x, need_weights=True, average_attn_weights=average, **kw)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-12)
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-12)  # (B, L, S) or (B, H, L, S)


def declared_unsupported(cls, key: str, value) -> bool:
    allowed = cls._supports_.get(key, value)
    return value not in (allowed if isinstance(allowed, (list, tuple)) else [allowed])


@pytest.mark.parametrize("name,options", CONFIGS)
def test_unsupported_cases_raise_not_implemented_and_are_declared(name, options):
    cls = load(name)
    model = cls(embed_dim=E, num_heads=H, **options).double()
    x, k, v = (torch.randn(B, L, E, dtype=torch.float64) for _ in range(3))
    with pytest.raises(NotImplementedError, match="cross-attention"):
        model(x, k, v)
    assert declared_unsupported(cls, "cross", True) and cls._supports_["reason"]
    if options.get("attn_implementation") != "eager":  # BERT eager returns weights (tested above)
        with pytest.raises(NotImplementedError, match="need_weights"):
            model(x, x, x, need_weights=True)
    if "attn_implementation" in options:
        with pytest.raises(NotImplementedError, match="bias"):
            cls(embed_dim=E, num_heads=H, bias=False, **options)
        assert declared_unsupported(cls, "bias", False)
    else:  # timm's Attention has qkv_bias and proj_bias: bias=False is supported
        ref = reference(bias=False)
        model = cls(embed_dim=E, num_heads=H, bias=False).double()
        model.load_state_dict(ref.state_dict(), strict=True)
        torch.testing.assert_close(
            model(x, x, x)[0], ref(x, x, x, need_weights=False)[0], rtol=0, atol=1e-12
        )


def test_declarations_are_valid_for_the_harness():
    loaded = {name: _load(name)[0] for name in ADAPTERS}
    if not any(loaded.values()):
        pytest.skip("; ".join(_load(name)[1] for name in ADAPTERS))
    for name, cls in loaded.items():
        if cls is not None:
            parse_declaration(cls._supports_, f"{name}._supports_", "_supports_")


def test_bert_refuses_an_unknown_attn_implementation():
    cls = load("hf_bert")
    with pytest.raises(ValueError, match="attn_implementation='flash'"):
        cls(embed_dim=E, num_heads=H, attn_implementation="flash")


def test_harness_checks_every_adapter_end_to_end(harness_cli, tmp_path):
    """One sweep over every adapter, as a user runs it (one CLI run: ~12 s of start-up alone).
    Where a library imports, its rows are ok, or unsupported where the module cannot do the case,
    and name the library's version; where it does not import, every row is unsupported saying
    why. A library missing here is not a failed check: the gate passes when one library checked
    a point, and with neither installed (a fresh clone) it exits 1 saying that no point was
    checked, which is what it must say of such a sweep."""
    proc = harness_cli(
        "-m",
        "--config-dir",
        str(REPO / "examples" / "conf"),
        f"variant={','.join(ADAPTERS)}",
        "mask=none,causal",
        "need_weights=false,true",
        "check_only=true",
        *TINY,
        "hydra.sweep.dir=sweep",
    )
    if all(_load(name)[0] is None for name in ADAPTERS):
        assert proc.returncode == 1 and "FAILED (no point was checked)" in proc.stdout, proc.stdout[
            -3000:
        ]
        assert "check failed" not in proc.stderr  # nothing failed its check: nothing was checked
    else:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    df = pd.read_csv(
        tmp_path / "sweep" / "results.csv", dtype={"error": str, "variant_distribution": str}
    ).fillna({"error": "", "variant_distribution": ""})
    assert sorted(zip(df["variant"], df["mask"], df["need_weights"])) == sorted(
        itertools.product(ADAPTERS, ["causal", "none"], [False, True])
    )
    for name, library in (("timm_vit", "timm "), ("hf_bert", "transformers ")):
        rows = df[df["variant"] == name]
        if _load(name)[0] is None:
            assert (rows["status"] == "unsupported").all(), rows[["status", "error"]]
            built = rows[
                ~rows["need_weights"]
            ]  # the others are outside its declaration: never built
            assert built["error"].str.contains("does not import here").all(), list(rows["error"])
            continue
        ok = rows[~rows["need_weights"]]
        assert (ok["status"] == "ok").all() and ok["check_passed"].all(), ok[
            ["mask", "status", "error"]
        ]
        assert ok["variant_distribution"].str.contains(library).all(), list(
            ok["variant_distribution"]
        )
        # neither timm nor BERT's default sdpa returns weights: declared (timm) or
        # NotImplementedError (BERT)
        weights = rows[rows["need_weights"]]
        assert (weights["status"] == "unsupported").all(), weights[["status", "error"]]
        assert weights["error"].str.contains("weights").all(), list(weights["error"])
