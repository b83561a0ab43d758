"""The variant contract, against a real nn.MultiheadAttention, every variant and every toggle.

Float64 so that any difference is a bug, not rounding; biases randomised because nn.MHA
zero-initialises them and a zero bias hides bias bugs.
"""

import itertools

import pytest
import torch
import torch.nn as nn
from hydra import compose, initialize_config_dir
from hydra.utils import get_class
from omegaconf import OmegaConf

from tests.conftest import REPO, VARIANT_NAMES

B, L, S, E, H = 2, 5, 7, 16, 4


def variant_configs():
    """(name, target, options) for every conf/variant yaml, with every value of its toggles."""
    out = []
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        for name in VARIANT_NAMES:
            cfg = OmegaConf.to_container(compose("config", overrides=[f"variant={name}"]).variant)
            target = cfg.pop("_target_")
            toggles = {"attention": ["manual", "sdpa", "flex"], "merge": ["view", "reshape"]}
            keys = [k for k in cfg if k in toggles]
            for values in itertools.product(*(toggles[k] for k in keys)):
                opts = {**cfg, **dict(zip(keys, values))}
                if opts.get("attention") == "flex" and opts.get("merge") == "reshape":
                    continue  # the merge is the same code for every kernel; flex with view is enough
                out.append(pytest.param(name, target, opts, id="-".join([name, *map(str, values)])))
    return out


def reference(bias: bool) -> nn.MultiheadAttention:
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, bias=bias, batch_first=True).double()
    if bias:
        with torch.no_grad():
            ref.in_proj_bias.normal_()
            ref.out_proj.bias.normal_()
    return ref


def test_every_variant_has_a_config():
    assert {"reference", "separate", "fused", "packed"} <= set(VARIANT_NAMES)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("name,target,options", variant_configs())
def test_variant_matches_reference(name, target, options, bias, eager_flex):
    ref = reference(bias)
    model = get_class(target)(embed_dim=E, num_heads=H, bias=bias, **options).double()
    model.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, L, E, generator=g, dtype=torch.float64)
    k = torch.randn(B, S, E, generator=g, dtype=torch.float64)
    v = torch.randn(B, S, E, generator=g, dtype=torch.float64)
    for query, key, value in [(x, x, x), (x, k, v)]:  # self- and cross-attention
        Lk = key.size(1)
        causal = torch.ones(L, Lk, dtype=torch.bool).triu(1)
        padding = torch.zeros(B, Lk, dtype=torch.bool)
        padding[0, -2:] = True
        float_mask = torch.randn(L, Lk, generator=g, dtype=torch.float64)
        cases = {
            "none": {},
            "causal": dict(attn_mask=causal, is_causal=True),
            "padding": dict(key_padding_mask=padding),
            "causal+padding": dict(attn_mask=causal, key_padding_mask=padding),
            "float mask": dict(attn_mask=float_mask),
            "weights": dict(need_weights=True, attn_mask=causal),
            "per-head weights": dict(need_weights=True, average_attn_weights=False, key_padding_mask=padding),
        }
        for case, kwargs in cases.items():
            kwargs = {"need_weights": False, **kwargs}
            want, want_w = ref(query, key, value, **kwargs)
            with torch.set_grad_enabled(options.get("attention") != "flex"):  # no flex backward on CPU
                got, got_w = model(query, key, value, **kwargs)
            where = f"{name} {options} bias={bias} {'self' if key is query else 'cross'} {case}"
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=where)
            if want_w is None:
                assert got_w is None, where
            else:
                torch.testing.assert_close(got_w, want_w, rtol=1e-10, atol=1e-10, msg=where)


@pytest.mark.parametrize("target", ["variants.separate.SeparateProjMHA", "variants.fused.FusedQKVMHA",
                                    "variants.packed.PackedHeadsMHA"])
def test_bad_options_raise_value_error_naming_them(target):
    cls = get_class(target)
    with pytest.raises(ValueError, match="merge='transpose'"):
        cls(embed_dim=E, num_heads=H, bias=True, merge="transpose")
    with pytest.raises(ValueError, match="attention='flash'"):
        cls(embed_dim=E, num_heads=H, bias=True, attention="flash")
    with pytest.raises(ValueError, match="embed_dim=10 is not divisible by num_heads=4"):
        cls(embed_dim=10, num_heads=4, bias=True)


def test_packed_without_the_permutation_is_wrong():
    """The trap packed.py exists to avoid: nn.MHA's [Wq; Wk; Wv] copied straight in."""
    from variants.packed import PackedHeadsMHA

    ref = reference(True)
    model = PackedHeadsMHA(E, H).double()
    with torch.no_grad():
        model.qkv.weight.copy_(ref.in_proj_weight)
        model.qkv.bias.copy_(ref.in_proj_bias)
        model.out_proj.load_state_dict(ref.out_proj.state_dict())
    x = torch.randn(B, L, E, dtype=torch.float64)
    want, _ = ref(x, x, x, need_weights=False)
    got, _ = model(x, x, x)
    assert (got - want).abs().max() > 1e-3
