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
from harness.factory import make_point
from tests.conftest import REPO, WAYS

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
    "two_mistakes": lambda mask, mode: True,
    "causal_unmasked": lambda mask, mode: mask != "causal",  # right where causal was asked
    "sdpa_mask_uninverted": lambda mask, mode: mask == "causal",  # the padding it inverts
}
# What a flagged control's row must say about its cause: the known mistake its ``diagnosis``
# names (harness/way/mistakes.py; others may be named beside it where they compute the same
# thing at that point: at E=16, H=4 a 1/sqrt(E) scale is 1/D, the scale applied twice), or,
# where no single known mistake explains it, ``None`` and what its localisation must say
# (``LOCATED``).
NAMED = {
    "no_permute": "heads_merged_without_permute",
    "sqrt_embed_dim": "scale_sqrt_embed_dim",
    "kv_with_q_weights": "kv_with_query_weights",
    "softmax_wrong_axis": "softmax_query_axis",
    "bias_dropped": "biases_dropped",
    "packed_unpermuted": "fused_read_per_head",
    "mask_not_applied": "masks_ignored",
    "key_detached": "key_detached",
    "flex_mask_uninverted": "padding_mask_inverted",
    "gqa_tiled": "gqa_tiled",
    "window_one_wide": "window_one_wide",
    "unstable_softmax": None,
    "global_max_softmax": None,
    "two_mistakes": None,
    "cache_one_off": None,
    "causal_unmasked": "causal_without_mask",
    "sdpa_mask_uninverted": "attn_mask_inverted",  # its last row hidden whole: SDPA's zeros
    "gqa_first_heads": "gqa_first_heads",
}
# Cases where a named control's output has no finite element to tell its cause by: the softmax
# over the queries of a padded key column is NaN, and p @ v spreads it over every output (an
# all-NaN output matches any other; harness/way/diagnose.py names nothing on it).
NOT_NAMED = {"softmax_wrong_axis": lambda case: case["mask"] == "padding"}
# (case fields) -> the localisation's columns where no name is given, or where it says more.
LOCATED = {
    "softmax_wrong_axis": lambda row, case: (
        case["mask"] != "padding"
        or "NaN/Inf" in row["wrong_where"]
        and "all 6 query rows" in row["wrong_where"]
    ),
    # exp overflows at activation scale: NaN/Inf in some rows, which the sentence says
    "unstable_softmax": lambda row, case: (
        row["wrong_in"] == "forward"
        and "NaN/Inf" in row["wrong_where"]
        and row["failed_scale"] == "activation"
    ),
    # rows far below the global max underflow: some rows, the forward
    "global_max_softmax": lambda row, case: (
        row["wrong_in"] == "forward" and row["failed_scale"] == "activation"
    ),
    "two_mistakes": lambda row, case: (
        row["wrong_in"] == "forward"
        and row["wrong_heads"] == "0-3"
        and "all 4 heads" in row["wrong_where"]
    ),
    # a wrong cache: every new row differs; with the attention weights, at the cache's end
    "cache_one_off": lambda row, case: row["wrong_in"] == "forward" and row["wrong_rows"] == "0-1",
    # the key path detached: only gradients, and in them the key rows of in_proj_weight
    "key_detached": lambda row, case: (
        row["wrong_in"] == "gradients"
        and "grad_in_proj_weight (K rows of all 4 heads)" in row["wrong_where"]
    ),
    # grouped K/V heads tiled: query heads 0 and 3 read the right K/V head by chance
    "gqa_tiled": lambda row, case: row["wrong_heads"] == "1-2",
    # a window one too wide: the rows whose window is full (query 3 and on, window=3)
    "window_one_wide": lambda row, case: (
        case.get("kv_cache_len") is not None or row["wrong_rows"] == "3-5"
    ),
    # causal unapplied: every row but the last, which sees every key anyway
    "mask_not_applied": lambda row, case: case["mask"] != "causal" or row["wrong_rows"] == "0-4",
}


def explained(name: str, row: dict, case: dict) -> str:
    """What is wrong with a flagged control's diagnosis or localisation ("" if nothing)."""
    names = (row.get("diagnosis") or "").split(";")
    expected = None if NOT_NAMED.get(name, lambda c: False)(case) else NAMED[name]
    if expected is None and names != ["none"]:
        return f"diagnosis {row.get('diagnosis')!r}, expected none"
    if expected is not None and expected not in names:
        return f"diagnosis {row.get('diagnosis')!r}, expected {expected}"
    if name in LOCATED and not LOCATED[name](row, case):
        return f"located {row.get('wrong_where')!r} (heads {row.get('wrong_heads')})"
    if "Where: " not in row["error"] or "Diagnosis: " not in row["error"]:
        return f"error without its diagnosis: {row['error']!r}"
    return ""


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
    point = make_point("fused", variant=variant, **{**shape, **fields})
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
    "gqa_first_heads": (
        dict(num_kv_heads=2),
        [dict(mask=m, mode=mode) for m, mode in itertools.product(MASKS, MODES)],
        {"_target_": "variants.separate.SeparateProjMHA", "attention": "manual", "merge": "view"},
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
        elif said := explained(name, wrong, fields):
            missed.append(f"{fields}: {said}")
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
        assert row["latency_ms_median"] is None  # check_only: no timing
        if flagged != SHOWS[name](mask, mode):
            wrong.append(
                f"{dtype} {mask} {mode}: flagged={flagged} "
                f"({row['worst_tensor']} err {row['max_abs_err']:.3g} tol {row['tolerance']:.3g})"
            )
        elif flagged and (said := explained(name, row, dict(mask=mask, mode=mode))):
            wrong.append(f"{dtype} {mask} {mode}: {said}")
        elif not flagged and row.get("diagnosis"):
            wrong.append(f"{dtype} {mask} {mode}: passed, yet diagnosed {row['diagnosis']}")
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
    assert row["error"].startswith("out: max_abs_err="), row["error"]  # the output, said first
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


# plain MHA's (latent's: tests/test_latent.py); the first structure here, every one (25-30 s
# each here) in make test-slow and CI
@pytest.mark.parametrize(
    "name", [w if i == 0 else pytest.param(w, marks=pytest.mark.slow) for i, w in enumerate(WAYS)]
)
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
