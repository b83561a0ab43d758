"""The variant contract, against a real nn.MultiheadAttention, every variant and every toggle.

Float64 so that any difference is a bug, not rounding; biases randomised because nn.MHA
zero-initialises them and a zero bias hides bias bugs.
"""

import itertools

import pandas as pd
import pytest
import torch
import torch.nn as nn
from hydra import compose, initialize_config_dir
from hydra.utils import get_class
from omegaconf import OmegaConf

from harness.way import kernels
from harness.declarations import MERGES
from tests.conftest import REPO, TINY, VARIANT_NAMES, WAYS

B, L, S, E, H = 2, 5, 7, 16, 4


# Every kernel of the registry that runs on this CPU (in float64: the contract is exact).
HERE = [
    n
    for n in kernels.builtin()
    if "cpu" in kernels.get(n).devices and kernels.get(n).unavailable() is None
]


def variant_configs():
    """(name, target, options) for every conf/variant yaml, with every value of its toggles."""
    out = []
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        for name in WAYS:  # plain MHA's (latent attention's: tests/test_latent.py)
            cfg = OmegaConf.to_container(compose("config", overrides=[f"variant={name}"]).variant)
            target = cfg.pop("_target_")
            toggles = {"attention": HERE, "merge": list(MERGES)}
            keys = [k for k in cfg if k in toggles]
            for values in itertools.product(*(toggles[k] for k in keys)):
                opts = {**cfg, **dict(zip(keys, values))}
                if opts.get("attention") == "flex" and opts.get("merge") == "reshape":
                    # the merge is the same code for every kernel; flex with view is enough
                    continue
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
            "per-head weights": dict(
                need_weights=True, average_attn_weights=False, key_padding_mask=padding
            ),
        }
        for case, kwargs in cases.items():
            kwargs = {"need_weights": False, **kwargs}
            want, want_w = ref(query, key, value, **kwargs)
            with torch.set_grad_enabled(
                options.get("attention") != "flex"
            ):  # no flex backward on CPU
                got, got_w = model(query, key, value, **kwargs)
            where = f"{name} {options} bias={bias} {'self' if key is query else 'cross'} {case}"
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=where)
            if want_w is None:
                assert got_w is None, where
            else:
                torch.testing.assert_close(got_w, want_w, rtol=1e-10, atol=1e-10, msg=where)


@pytest.mark.parametrize(
    "target",
    [
        "variants.separate.SeparateProjMHA",
        "variants.fused.FusedQKVMHA",
        "variants.packed.PackedHeadsMHA",
    ],
)
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


OUTSIDE_KERNEL = '''"""SDPA written out by hand, as a user adding a kernel would: one file,
nothing else."""
import torch.nn.functional as F

from variants.kernels import Kernel


def attend(q, k, v, m):  # q (B, H, L, D), k/v (B, H, S, D) -> (B, H, L, D)
    scale = SCALE or q.size(-1) ** -0.5
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m.merged(q.dtype), scale=scale)


SCALE = None
KERNEL = Kernel(name=__name__.rsplit(".", 1)[-1], fn=attend, masks=("none", "padding"),
                reason="no causal hint handled here", doc="SDPA with the scale written out")
'''


def test_a_kernel_is_one_new_file_and_a_sweep_finds_it(harness_cli, tmp_path):
    """A kernel in a package of its own (a temporary one), named by module path: its declared
    masks are applied, the checker passes it, and a wrong copy of it (scale 1/D) is caught."""
    package = tmp_path / "outside" / "mykernels"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "scaled.py").write_text(OUTSIDE_KERNEL)
    (package / "unscaled.py").write_text(OUTSIDE_KERNEL.replace("SCALE = None", "SCALE = 1.0"))
    tiny = [a for a in TINY if not a.startswith("variant")]
    proc = harness_cli(
        "-m",
        "variant=fused,separate",
        "variant.attention=mykernels.scaled,mykernels.unscaled",
        "mask=none,causal,padding",
        "check_only=true",
        *tiny,
        "hydra.sweep.dir=sweep",
        paths=[tmp_path / "outside"],
    )
    df = pd.read_csv(tmp_path / "sweep" / "results.csv")
    assert len(df) == 12, proc.stderr[-2000:]
    scaled = df[df["variant_options"].str.contains("attention=mykernels.scaled ")]
    assert set(scaled[scaled["mask"] != "causal"]["status"]) == {"ok"}, scaled[["status", "error"]]
    causal = scaled[scaled["mask"] == "causal"]
    assert set(causal["status"]) == {"unsupported"}
    assert (
        causal["error"]
        .str.contains("mask=causal: attention=scaled declares mask=none|padding", regex=False)
        .all()
    )
    unscaled = df[
        df["variant_options"].str.contains("attention=mykernels.unscaled ")
        & (df["mask"] != "causal")
    ]
    assert set(unscaled["status"]) == {"mismatch"}
    assert proc.returncode == 1  # check_only: a check failed


class _Named(__import__("variants.fused", fromlist=["FusedQKVMHA"]).FusedQKVMHA):
    """A class that names every key the harness may hand a constructor."""

    seen: dict = {}

    def __init__(
        self, embed_dim, num_heads, bias=True, attention="sdpa", merge="view",
        num_kv_heads=None, position_bias="none", sinks=False, rotary=None, qk_norm=None,
        window=None, kv_cache_len=None,
    ):  # fmt: skip
        type(self).seen = {
            k: v for k, v in locals().items() if k not in ("self", "__class__")
        }
        super().__init__(
            embed_dim, num_heads, bias, attention, merge, num_kv_heads, position_bias, sinks,
            rotary, qk_norm,
        )  # fmt: skip


class _Wrapper(_Named):
    """``__init__(self, *args, **kwargs)``: a library class's wrapper hands every key on."""

    got: dict = {}

    def __init__(self, *args, **kwargs):
        type(self).got = dict(kwargs)
        super().__init__(*args, **kwargs)


@pytest.mark.parametrize(
    "fields",
    [
        dict(mask="sliding", window=4, num_kv_heads=2),
        dict(seq_len=1, kv_cache_len=8),
        dict(position_bias="alibi"),
        dict(sinks=True),
        dict(rotary="half"),
        dict(qk_norm="head"),
    ],
)
def test_every_key_reaches_a_wrapper_as_it_reaches_a_class_that_names_it(fields):
    """Issue 73: a ``*args, **kwargs`` wrapper was not passed ``window`` (it got num_kv_heads,
    sinks and position_bias) and ran without its window."""
    from harness.factory import make_point
    from harness.way.build import build_variant
    from harness.way.inputs import make_reference

    point = make_point(
        "fused", batch=2, embed_dim=32, num_heads=4, device="cpu",
        **{"seq_len": 16, **fields},
    )  # fmt: skip
    reference = make_reference(point)
    build_variant(point, reference, _Named)
    defaults = {
        k: v.default
        for k, v in __import__("inspect").signature(_Named.__init__).parameters.items()
        if k != "self"
    }
    named = {k for k, v in _Named.seen.items() if v != defaults[k]} - {"embed_dim", "num_heads"}
    build_variant(point, reference, _Wrapper)
    handed = set(_Wrapper.got) - {"embed_dim", "num_heads", "bias", "attention", "merge"}
    assert handed == named and handed, (handed, named)


class _BuiltInBfloat16(_Named):
    """A library block that creates its parameters in bfloat16 (the gpt-oss package's does)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.to(torch.bfloat16)


def test_a_module_built_in_a_lower_dtype_is_told_its_weights_were_rounded(monkeypatch):
    """Issue 73: nn.MHA's float weights loaded into bfloat16 parameters are rounded before the
    cast; the check's mismatch says so, with the fix, where it said only "none of the known
    mistakes"."""
    from harness.factory import make_point
    from harness.point import run_point
    from harness.way import capabilities

    point = make_point("fused", batch=2, seq_len=8, embed_dim=32, num_heads=4, device="cpu",
                       check_only=True)  # fmt: skip
    monkeypatch.setattr(capabilities, "variant_class", lambda spec: _BuiltInBfloat16)
    row = run_point(point)
    assert row["status"] == "mismatch", row
    assert "were bfloat16 when nn.MHA's weights were loaded" in row["error"], row["error"]
    assert "create its parameters in float32" in row["error"]
    monkeypatch.setattr(capabilities, "variant_class", lambda spec: _Named)
    assert run_point(point)["status"] == "ok"


def test_an_outside_kernel_that_raises_on_import_is_one_line_and_its_point_a_row(
    harness_cli, tmp_path, monkeypatch, capsys
):
    """Issue 74: a kernel module raising a non-ImportError as it imports killed the worker
    (``crashed``) and ``mha-bench kernels MODULE`` printed its traceback; a newline in a kernel's
    doc broke the kernels table."""
    from harness.way import kernels

    package = tmp_path / "outside" / "mykernels"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "raising.py").write_text('raise RuntimeError("needs a GPU at import")\n')
    (package / "wordy.py").write_text(
        OUTSIDE_KERNEL.replace('doc="SDPA with the scale written out"',
                               'doc="SDPA with the scale\\nwritten out"')  # fmt: skip
    )
    monkeypatch.syspath_prepend(str(tmp_path / "outside"))
    assert kernels.main(["mykernels.raising"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "importing mykernels.raising raised RuntimeError" in err
    assert kernels.main(["mykernels.wordy"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "mykernels.wordy" in line]
    assert len(rows) == 1 and "SDPA with the scale written out" in rows[0], rows
    tiny = [a for a in TINY if not a.startswith("variant")]
    proc = harness_cli(
        "-m", "variant=fused", "variant.attention=mykernels.raising,sdpa", "check_only=true",
        *tiny, "hydra.sweep.dir=sweep", paths=[tmp_path / "outside"],
    )  # fmt: skip
    df = pd.read_csv(tmp_path / "sweep" / "results.csv")
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    assert len(df) == 2 and "crashed" not in set(df["status"]), df[["status", "error"]]
    raised = df[df["variant_options"].str.contains("mykernels.raising")]
    assert raised["status"].iloc[0] == "invalid", raised[["status", "error"]]
    assert "raised RuntimeError: needs a GPU at import" in raised["error"].iloc[0]
