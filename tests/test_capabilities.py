"""A variant's declared capabilities (_supports_, _fixed_), variant-specific options in sweeps over
several variants, and the one-row-per-configuration rule for fixed values
(harness/way/capabilities.py)."""

import pandas as pd
import pytest

from harness.way import capabilities
from harness.report import catalogue
from harness.report import render as report
from harness.declarations import parse_declaration
from harness.config import InvalidPoint
from harness.point import run_point
from harness.results import distinct
from harness.factory import make_point
from tests.conftest import REPO, TINY, run_harness
from variants.fused import FusedQKVMHA

SMALL = dict(batch=1, seq_len=6, embed_dim=8, num_heads=2, device="cpu", check_only=True)


class SelfOnly(FusedQKVMHA):
    """Declares, as class attributes, what it cannot do; counts how often it is built."""

    _supports_ = {"cross": False, "mask": ["none", "causal"], "reason": "no key/value of its own"}
    built = 0

    def __init__(self, *args, **kwargs):
        type(self).built += 1
        super().__init__(*args, **kwargs)


class NoBias(FusedQKVMHA):
    _fixed_ = {"bias": False}

    def __init__(self, embed_dim, num_heads, bias=True, **kwargs):
        if bias:
            raise NotImplementedError("NoBias has no biases")
        super().__init__(embed_dim, num_heads, bias, **kwargs)


class Chatty(FusedQKVMHA):
    def __init__(self, embed_dim, num_heads, bias=True, verbose=True):
        super().__init__(embed_dim, num_heads, bias)
        self.verbose = verbose


def declared(target, **yaml):
    return {"_target_": f"{__name__}.{target}", **yaml}


def test_a_declaration_is_checked_like_the_config_and_names_the_bad_key():
    assert parse_declaration(
        {"mask": "none", "compile": False, "reason": "r"}, "v", "_supports_"
    ) == {
        "mask": ("none",),
        "compile": ("off",),
        "reason": {"mask": "r", "compile": "r"},  # one reason: every key's
    }  # one value or a list; YAML's `off` reads False
    with pytest.raises(InvalidPoint, match=r"v\.masks is not a key .*did you mean mask\?"):
        parse_declaration({"masks": ["none"]}, "v", "_supports_")
    with pytest.raises(InvalidPoint, match=r"v\.mask='nonee' is not one of none\|causal\|padding"):
        parse_declaration({"mask": ["none", "nonee"]}, "v", "_supports_")
    with pytest.raises(
        InvalidPoint, match=r"v\.embed_dim is not a key .* there"
    ):  # sizes cannot be fixed
        parse_declaration({"embed_dim": 64}, "v", "_fixed_")
    with pytest.raises(
        InvalidPoint, match="variant=fused: _supports_.bias='yes' is not one of true|false"
    ):
        make_point("fused", **SMALL, variant={"_supports_": {"bias": "yes"}})


def test_a_point_outside_the_declaration_is_unsupported_with_the_reason_and_never_built():
    SelfOnly.built = 0
    row = run_point(make_point("fused", **SMALL, cross=True, variant=declared("SelfOnly")))
    assert row["status"] == "unsupported"
    assert (
        row["error"] == "cross=true: variant=fused declares cross=false (no key/value of its own)"
    )
    row = run_point(make_point("fused", **SMALL, mask="padding", variant=declared("SelfOnly")))
    assert row["error"].startswith("mask=padding: variant=fused declares mask=none|causal")
    assert SelfOnly.built == 0
    assert (
        run_point(make_point("fused", **SMALL, mask="causal", variant=declared("SelfOnly")))[
            "status"
        ]
        == "ok"
    )
    assert SelfOnly.built == 1
    # the yaml wins over the class, key by key: here it allows padding and keeps cross=false
    row = run_point(
        make_point(
            "fused",
            **SMALL,
            mask="padding",
            cross=True,
            variant=declared("SelfOnly", _supports_={"mask": ["padding"]}),
        )
    )
    assert row["error"].startswith("cross=true")


def test_a_fixed_value_replaces_the_asked_one_and_the_row_says_so():
    row = run_point(make_point("fused", **SMALL, bias=True, variant=declared("NoBias")))
    assert (row["status"], row["bias"], row["fixed"]) == ("ok", False, "bias=false (asked true)")
    row = run_point(make_point("fused", **SMALL, bias=False, variant=declared("NoBias")))
    assert (row["status"], row["fixed"]) == ("ok", "")  # ran as asked
    point, note, why, *_ = capabilities.apply(
        make_point(
            "fused",
            **SMALL,
            mode="fwd_bwd",
            variant=declared("NoBias", _fixed_={"mode": "fwd"}, _supports_={"dtype": "float32"}),
        )
    )
    assert (point.mode, point.bias, why) == (
        "fwd",
        False,
        None,
    )  # the yaml's keys add to the class's
    assert note == "bias=false (asked true); mode=fwd (asked fwd_bwd)"


def test_fixed_rows_that_repeat_a_point_run_as_asked_are_left_out_of_figures_and_rankings():
    keys = dict(
        variant="mine",
        variant_options="",
        compile="off",
        sdpa_backend="auto",
        batch=1,
        seq_len=8,
        kv_seq_len=8,
        embed_dim=16,
        num_heads=2,
        dtype="float32",
        device="cpu",
        mask="none",
        mask_format="bool",
        mode="fwd",
        cross=False,
        bias=False,
        need_weights=False,
        average_attn_weights=True,
        seed=0,
        num_threads=1,
        status="ok",
        label="mine",
    )
    ci = dict(speedup_ci_low=0.9, speedup_ci_high=2.1)
    df = pd.DataFrame(
        [
            {
                **keys,
                "fixed": "bias=false (asked true)",
                "speedup": 1.0,
                "latency_ms_median": 1.0,
                **ci,
            },
            {**keys, "fixed": "", "speedup": 2.0, "latency_ms_median": 0.5, **ci},
            {
                **keys,
                "variant": "fused",
                "label": "fused",
                "fixed": "",
                "speedup": 1.5,
                "latency_ms_median": 0.7,
                **ci,
            },
        ]
    )
    kept = distinct(df)
    assert list(kept["speedup"]) == [2.0, 1.5]  # the row run as asked stays, in the original order
    table, _, _, _ = catalogue.speedups(report.prepare(df))  # a pivot: raises on repeats
    assert table.shape == (2, 1)
    assert len(distinct(df.drop(columns="fixed"))) == 3  # rows without the column: untouched


def test_a_sweep_mixes_capabilities_and_scopes_variant_options(tmp_path):
    """The user's sweep: project variants, the bias-free module, a module with an option of its own
    (`verbose`, which the default variant fused lacks: Hydra would refuse it for the sweep's own
    config), an option only some variants have, bias both ways. Every row is ok."""
    conf = tmp_path / "conf" / "variant"
    conf.mkdir(parents=True)
    (conf / "mine.yaml").write_text(
        (REPO / "examples" / "conf" / "variant" / "mine.yaml").read_text()
    )
    (conf / "chatty.yaml").write_text("_target_: tests.test_capabilities.Chatty\nverbose: true\n")
    proc = run_harness(
        "-m",
        "--config-dir",
        str(tmp_path / "conf"),
        "variant=fused,reference,mine,chatty",
        "variant.attention=manual,sdpa",
        "variant.verbose=false",
        "bias=true,false",
        "mask=causal",
        "check_only=true",
        *TINY,
        "hydra.sweep.dir=sweep",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        "note: variant.attention applies to fused; left out for chatty, mine, reference "
        "(no such option)"
    ) in proc.stdout
    assert (
        "note: variant.verbose applies to chatty; left out for fused, mine, reference"
        in proc.stdout
    )
    assert "note: 6 points left out" in proc.stdout  # all but fused would run twice per point
    df = pd.read_csv(tmp_path / "sweep" / "results.csv", keep_default_na=False)
    assert len(df) == 10 and set(df["status"]) == {"ok"}
    mine = df[df["variant"] == "mine"]
    assert set(mine["bias"]) == {False}
    assert sorted(mine["fixed"]) == ["", "bias=false (asked true)"]
    assert set(df[df["variant"] == "fused"]["label"]) == {
        "fused/attention=manual,merge=view",
        "fused/attention=sdpa,merge=view",
    }
    assert set(df[df["variant"] == "chatty"]["label"]) == {"chatty/verbose=False"}
    assert (mine["variant_target"] == "examples.mine.MyAttention").all()


def test_an_option_no_swept_variant_has_and_a_bad_declaration_are_refused_before_any_point(
    tmp_path,
):
    proc = run_harness(
        "-m",
        "--config-dir",
        str(REPO / "examples" / "conf"),
        "variant=mine,reference",
        "variant.atention=manual",
        *TINY,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: variant.atention is not an option of any variant in this sweep "
        "(mine: none; reference: none)"
    )
    (tmp_path / "conf" / "variant").mkdir(parents=True)
    (tmp_path / "conf" / "variant" / "bad.yaml").write_text(
        "_target_: examples.mine.MyAttention\n_supports_:\n  masks: [none]\n"
    )
    proc = run_harness(
        "-m", "--config-dir", str(tmp_path / "conf"), "variant=bad,fused", *TINY, cwd=tmp_path
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: variant=bad: _supports_.masks is not a key a variant can declare there "
        "(did you mean mask?)"
    )
    assert "sweep:" not in proc.stdout  # refused before the first point


class PerKeyReasons(FusedQKVMHA):
    _supports_ = {
        "cross": False,
        "mask": ["none", "padding"],
        "reason": {"cross": "no key/value of its own", "mask": "its mask path takes padding only"},
    }


class CausalOnlyChild(SelfOnly):
    """Declares one more key of its own: its base's declaration (cross, with its reason) stays."""

    _supports_ = {"mask": ["causal"], "reason": "it always hides the future"}


class Wrapped(FusedQKVMHA):
    """A wrapper written ``__init__(self, *args, **kwargs)``: every key passes through."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)


def _row(target: str, **fields) -> dict:
    point = make_point("fused", variant={"_target_": target}, **{**SMALL, **fields})
    return run_point(point)


def test_each_key_of_a_declaration_says_its_own_reason():
    target = f"{__name__}.PerKeyReasons"
    row = _row(target, mask="causal")
    assert row["status"] == "unsupported" and "its mask path takes padding only" in row["error"]
    assert "no key/value" not in row["error"], row["error"]
    row = _row(target, cross=True)
    assert row["status"] == "unsupported" and "no key/value of its own" in row["error"]
    assert _row(target, mask="padding")["status"] == "ok"


def test_a_subclass_declaration_adds_to_its_bases_key_by_key():
    target = f"{__name__}.CausalOnlyChild"
    row = _row(target, cross=True, mask="causal")  # the base's key, with the base's reason
    assert row["status"] == "unsupported" and "no key/value of its own" in row["error"], row
    row = _row(target, mask="none")  # its own key, with its own reason
    assert row["status"] == "unsupported" and "it always hides the future" in row["error"], row
    assert _row(target, mask="causal")["status"] == "ok"


def test_a_wrapper_taking_kwargs_gets_num_kv_heads():
    row = _row(f"{__name__}.Wrapped", num_heads=4, num_kv_heads=2, embed_dim=16)
    assert row["status"] == "ok", row["error"]


def test_a_reason_naming_an_undeclared_key_is_refused():
    with pytest.raises(InvalidPoint, match="reason names mask, not declared"):
        parse_declaration({"cross": False, "reason": {"mask": "x"}}, "w", "_supports_")


class OneContext(FusedQKVMHA):
    """A single-context cross-attention (diffusers', BERT's): one context tensor is both its key
    and its value, so it cannot take nn.MHA's separate key and value."""

    def forward(self, query, key, value, *args, **kwargs):
        if key is not query and key is not value:
            raise NotImplementedError("one context: its key is its value")
        return super().forward(query, key, value, *args, **kwargs)


def test_a_single_context_cross_attention_runs_where_the_key_is_the_value():
    target = f"{__name__}.OneContext"
    cross = dict(cross=True, kv_seq_len=9, mode="fwd_bwd")
    row = _row(target, **cross)  # nn.MHA's two tensors: not what it takes
    assert row["status"] == "unsupported" and "its key is its value" in row["error"], row
    row = _row(target, **cross, shared_kv=True)  # S != L, key is value, gradients through both
    assert row["status"] == "ok", row["error"]
    assert row["tensors_checked"] >= 4, row  # out, grad_query, grad_key (= grad_value), ...
    with pytest.raises(InvalidPoint, match="shared_kv=true is a cross-attention"):
        make_point("fused", shared_kv=True)


def test_a_kernels_limits_are_checked_as_a_variants_supports_when_it_is_made():
    """``Kernel.limits`` (the model features' values a kernel computes) is applied like a
    variant's _supports_; a key no point has, or a value its key cannot take, is one line naming
    it when the kernel's module is imported, not a crash at the first point it would refuse."""
    from harness.way.kernels import Kernel

    def fn(q, k, v, masks):
        return q

    kernel = Kernel(name="mine", fn=fn, doc="", limits={"sinks": False, "position_bias": "none"})
    assert kernel.supports()["sinks"] == (False,)
    assert kernel.supports()["position_bias"] == ("none",)
    assert "sinks" not in Kernel(name="all", fn=fn, doc="").supports()
    with pytest.raises(InvalidPoint, match=r"Kernel\.limits\.sink is not .*did you mean sinks"):
        Kernel(name="mine", fn=fn, doc="", limits={"sink": (False,)})
    with pytest.raises(InvalidPoint, match=r"position_bias='rope'"):
        Kernel(name="mine", fn=fn, doc="", limits={"position_bias": ("rope",)})
    with pytest.raises(InvalidPoint, match=r"Kernel\.reason"):
        Kernel(name="mine", fn=fn, doc="", limits={"sinks": (False,), "reason": "no"})
