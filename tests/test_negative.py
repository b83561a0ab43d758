"""The checker is neither blind nor too strict.

Blind: every negative control in tests/negative/ is flagged in every dtype, in every case where
its mistake shows. Too strict: the same code without the mistake, and every registered variant
with every toggle, passes in every case. All in-process with check_only (no timing).
attention=flex runs uncompiled here (conftest's eager_flex): these tests check its mask
translation; tests/test_flex.py runs the compiled kernel the harness times.
"""

import dataclasses
import itertools
import sys

import pytest
import yaml

from harness.point import run_point
from harness.sweep.run import point_for
from tests.conftest import REPO, VARIANT_NAMES

NEGATIVE = REPO / "tests" / "negative"
sys.path.insert(0, str(NEGATIVE))  # the gallery's modules, as PYTHONPATH would for --config-dir

DTYPES = ("float32", "float16", "bfloat16")
MASKS = ("none", "causal", "padding")
MODES = ("fwd", "fwd_bwd")
CASES = list(itertools.product(DTYPES, MASKS, MODES))

# Where each mistake must show (dtype, mask, mode) -> True; elsewhere it must pass.
SHOWS = {
    "no_permute": lambda mask, mode: True,
    "sqrt_embed_dim": lambda mask, mode: True,
    "kv_with_q_weights": lambda mask, mode: True,
    "softmax_wrong_axis": lambda mask, mode: True,
    "bias_dropped": lambda mask, mode: True,
    "packed_unpermuted": lambda mask, mode: True,
    "mask_not_applied": lambda mask, mode: mask != "none",
    "key_detached": lambda mask, mode: mode == "fwd_bwd",
    "flex_mask_uninverted": lambda mask, mode: mask == "padding",
    "textbook": lambda mask, mode: False,  # the control: correct
    # numerics: at activation scale only (tests/test_activation_scale.py shows both scales)
    "unstable_softmax": lambda mask, mode: True,
    "global_max_softmax": lambda mask, mode: True,
    "stable_softmax": lambda mask, mode: False,  # their control
}
# FlexAttention has no backward on CPU: there fwd_bwd is `unsupported`, with torch's reason.
NO_CPU_BACKWARD = "FlexAttention does not support backward on CPU"


def flex_backward(cfg: dict, mode: str, more: dict | None = None) -> bool:
    """FlexAttention's backward would run here (need_weights takes the explicit path instead)."""
    return (
        mode == "fwd_bwd"
        and not (more or {}).get("need_weights")
        and "flex" in str(cfg.get("attention"))
    )


def variant_cfg(root, name: str) -> dict:
    return yaml.safe_load((root / "variant" / f"{name}.yaml").read_text())


def check(variant: dict, name: str, **fields) -> dict:
    """Check (no timing) ``variant`` (a yaml's content) at a tiny CPU point of conf's defaults."""
    shape = dict(batch=2, seq_len=6, embed_dim=16, num_heads=4, device="cpu", check_only=True)
    point = point_for("fused", variant=variant, **{**shape, **fields})
    return run_point(
        dataclasses.replace(point, variant=dataclasses.replace(point.variant, name=name))
    )


# Mistakes in the attention models ship today, shown only with their feature: (the fields that
# turn it on, the cases it is checked in, the same code without the mistake). Flagged in every
# dtype and case; the control passes in every one.
FEATURES = {
    "gqa_tiled": (
        dict(num_kv_heads=2),
        [dict(mask=m, mode=mode) for m, mode in itertools.product(MASKS, MODES)],
        {"_target_": "variants.separate.SeparateProjMHA", "attention": "manual", "merge": "view"},
    ),
    "cache_one_off": (
        dict(kv_cache_len=5, seq_len=2),
        [dict(), dict(num_kv_heads=2), dict(mask="sliding", window=3), dict(kv_cache="concat")],
        {"_target_": "variants.separate.SeparateProjMHA", "attention": "sdpa", "merge": "view"},
    ),
    "window_one_wide": (
        dict(mask="sliding", window=3),
        [dict(), dict(mode="fwd_bwd"), dict(kv_cache_len=4, seq_len=3)],
        {"_target_": "mistakes.OwnWindow", "attention": "sdpa", "merge": "view", "window": 3},
    ),
}


def test_gallery_covers_every_mistake():
    assert {p.stem for p in (NEGATIVE / "variant").glob("*.yaml")} == set(SHOWS) | set(FEATURES)


@pytest.mark.parametrize("name", sorted(FEATURES))
def test_mistakes_of_grouped_heads_caches_and_windows_are_flagged(name):
    turn_on, cases, control = FEATURES[name]
    missed, strict = [], []
    for dtype, case in itertools.product(DTYPES, cases):
        fields = {**turn_on, **case, "dtype": dtype}
        wrong = check(variant_cfg(NEGATIVE, name), name, **fields)
        assert wrong["status"] in ("ok", "mismatch"), wrong
        if wrong["status"] != "mismatch":
            missed.append(f"{fields}: err {wrong['max_abs_err']:.3g} tol {wrong['tolerance']:.3g}")
        right = check(control, "control", **fields)
        if right["status"] != "ok":
            strict.append(f"{fields}: {right['status']} {right['error']}")
    assert not missed, f"{name} not flagged: " + "; ".join(missed)
    assert not strict, f"{name}'s control failed: " + "; ".join(strict)


@pytest.mark.parametrize("name", sorted(SHOWS))
def test_negative_control_is_flagged_where_its_mistake_shows(name, eager_flex):
    wrong = []
    for dtype, mask, mode in CASES:
        cfg = variant_cfg(NEGATIVE, name)
        row = check(cfg, name, dtype=dtype, mask=mask, mode=mode)
        if flex_backward(cfg, mode):
            assert row["status"] == "unsupported" and NO_CPU_BACKWARD in row["error"], row
            continue
        assert row["status"] in ("ok", "mismatch"), row
        flagged = row["status"] == "mismatch"
        assert flagged == (not row["check_passed"])
        assert "latency_ms_median" not in row  # check_only: no timing
        if flagged != SHOWS[name](mask, mode):
            wrong.append(
                f"{dtype} {mask} {mode}: flagged={flagged} "
                f"({row['worst_tensor']} err {row['max_abs_err']:.3g} tol {row['tolerance']:.3g})"
            )
    assert not wrong, f"{name}: " + "; ".join(wrong)


def test_mismatch_rows_name_the_tensor_and_the_size_of_the_error():
    row = check(variant_cfg(NEGATIVE, "key_detached"), "key_detached", mode="fwd_bwd")
    assert row["worst_tensor"] == "grad_in_proj_weight"
    assert row["max_abs_err"] > row["tolerance"] and row["err_ratio"] > 10
    assert "grad_in_proj_weight: max_abs_err=" in row["error"] and "at index (" in row["error"]
    row = check(variant_cfg(NEGATIVE, "mask_not_applied"), "mask_not_applied", mask="causal")
    assert row["worst_tensor"] == "out"


def test_a_mismatch_row_lists_every_failing_tensor_forward_first():
    # The unapplied mask is wrong in the output already; the gradients inherit it. The worst
    # tensor alone (a gradient, often) would hide that `out` is wrong.
    row = check(
        variant_cfg(NEGATIVE, "mask_not_applied"), "mask_not_applied", mask="causal", mode="fwd_bwd"
    )
    failed = row["failed_tensors"].split(";")
    assert failed[0] == "out" and len(failed) > 2 and all(n.startswith("grad_") for n in failed[1:])
    assert row["worst_tensor"] in failed
    ok = check(variant_cfg(NEGATIVE, "textbook"), "textbook", mask="causal", mode="fwd_bwd")
    assert ok["failed_tensors"] == ""


def toggled(name):
    cfg = variant_cfg(REPO / "conf", name)
    keys = [k for k in ("attention", "merge") if k in cfg]
    choices = {"attention": ("manual", "sdpa", "flex"), "merge": ("view", "reshape")}
    for values in itertools.product(*(choices[k] for k in keys)):
        options = dict(zip(keys, values))
        if options.get("attention") == "flex" and options.get("merge") == "reshape":
            continue  # the merge is the same code for every kernel; flex with view is enough
        yield {**cfg, **options}


EXTRAS = [
    dict(cross=True, kv_seq_len=4),
    dict(mask_format="additive"),
    dict(bias=False),
    dict(need_weights=True),
    dict(need_weights=True, average_attn_weights=False),
]


def covering():
    """Every (dtype, mask, mode) case plain, and every extra at every (mask, mode) with the dtype
    turning, so that each extra meets each dtype, mask and mode (pairwise): 48 checks per toggle
    where the full product is 108, and no pair of settings left untried."""
    yield from ((case, {}) for case in CASES)
    for i, more in enumerate(EXTRAS):
        for j, (mask, mode) in enumerate(itertools.product(MASKS, MODES)):
            yield (DTYPES[(i + j) % len(DTYPES)], mask, mode), more


@pytest.mark.parametrize("name", VARIANT_NAMES)
def test_every_correct_variant_passes_every_case(name, eager_flex):
    """Every toggle of every registered variant passes the covering set of cases (covering()):
    the longest in-process test (about 10-30 s per variant), as the checker's too-strict side is
    the one users meet first."""
    failed = []
    for cfg in toggled(name):
        for (dtype, mask, mode), more in covering():
            row = check(cfg, name, dtype=dtype, mask=mask, mode=mode, **more)
            if flex_backward(cfg, mode, more):
                if row["status"] != "unsupported" or NO_CPU_BACKWARD not in row["error"]:
                    failed.append(
                        f"{cfg} {dtype} {mask} {mode} {more}: {row['status']}, not unsupported"
                    )
            elif row["status"] != "ok":
                failed.append(
                    f"{cfg} {dtype} {mask} {mode} {more}: {row['status']} {row.get('error')}"
                )
    assert not failed, "\n".join(failed[:10])


def test_same_seed_same_inputs_same_weights_same_errors():
    cfg = variant_cfg(REPO / "conf", "packed")
    a, b = (
        check(cfg, "packed", dtype="bfloat16", mode="fwd_bwd", mask="padding") for _ in range(2)
    )
    keys = ("max_abs_err", "ref_err", "tolerance", "worst_tensor", "worst_index")
    assert [a[k] for k in keys] == [b[k] for k in keys]
    c = check(cfg, "packed", dtype="bfloat16", mode="fwd_bwd", mask="padding", seed=1)
    assert c["max_abs_err"] != a["max_abs_err"]
