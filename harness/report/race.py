"""Your module against every built-in way at your shape, in words (``mha-bench race``): which way
to use, which of its factors matter there and which make no difference, and how your module
compares with the way to use, paired round by round.

"Yours" is any way whose variant is not one of this package's (its ``variant_target`` is not
under ``variants.``): a module of your own, or a library's through an adapter. At every shape
where one of yours and the built-in ways were timed, the recommendation is read off what the
sweep measured, never a rule of thumb:

- the way to use: the built-in way with the highest speedup over nn.MultiheadAttention
  (ranking.rank_shape over the built-in ways alone);
- per factor of that way the sweep varied (structure, attention, merge, compile, ...): the
  effect pairs at that shape (effects.csv) that differ in that factor only, turned to read
  "the best's value against each other value", summed up as the findings do (the spread over
  the pairs' contexts, effects.summarize_pairs): a factor matters where its value is faster
  than another, and makes no difference where every other value ties with it;
- your module against the way to use: their times paired round by round (effects.effect_row,
  as ``mha-bench paired`` does), with the interval and verdict of an effect.

A shape where a way stayed contended (a busy machine) decides nothing and says so; a module of
yours that failed its check is named with its status and first error line, not timed.
"""

from __future__ import annotations

import math

import pandas as pd

from harness.report.busy import flag
from harness.report.effects import MODEL_KEYS, direction, effect_row, summarize_pairs
from harness.report.ranking import rank_shape
from harness.report.ways import way_name
from harness.results import factors, number, way

BUILT_IN = "variants."  # the package of the built-in ways: a variant_target under it is ours


def yours(row: dict) -> bool:
    """A way written outside this package: a user's module or a library adapter."""
    target = str(row.get("variant_target") or "")
    return bool(target) and target != "nan" and not target.startswith(BUILT_IN)


def _x(value: float) -> str:
    return f"{value:.2f}x" if value < 10 else f"{value:.0f}x"


def _iv(center: float, low: float, high: float) -> str:
    if math.isnan(low) or math.isnan(high):
        return f"{_x(center)} (no interval)"
    return f"{_x(center)} [{low:.2f}, {high:.2f}]"


def _toward(row: dict, value: str) -> dict:
    """An effect pair turned to read "``value``'s speed against the other's" (above 1: faster)."""
    ratio, low, high = (number(row.get(k)) for k in ("ratio", "ratio_ci_low", "ratio_ci_high"))
    if str(row["alternative"]) != value:  # effects' ratio is baseline time / alternative time
        ratio, low, high = 1 / ratio, 1 / high, 1 / low
    other = row["baseline"] if str(row["alternative"]) == value else row["alternative"]
    verdict = "busy" if row.get("verdict") == "busy" else direction(low, high)
    return {
        "other": str(other),
        "ratio": ratio,
        "ratio_ci_low": low,
        "ratio_ci_high": high,
        "verdict": verdict,
        "rerun_noise": row.get("rerun_noise"),
        "eager_ratio": math.nan,
        "eager_ratio_ci_low": math.nan,
        "eager_ratio_ci_high": math.nan,
    }


def factor_said(best: dict, factor: str, pairs: pd.DataFrame) -> tuple[bool, str]:
    """(whether ``factor`` matters, its part of the sentence): the best way's value of it against
    every other value the pairs hold ("attention=sdpa: 1.29x [1.25, 1.33] faster than manual, the
    same as flex")."""
    value = factors(best)[factor]
    mine = pairs[(pairs["factor"] == factor)]
    mine = mine[
        (mine["baseline"].astype(str) == value) | (mine["alternative"].astype(str) == value)
    ]
    turned = pd.DataFrame([_toward(r, value) for r in mine.to_dict("records")])
    if turned.empty:
        return False, ""
    parts, matters = [], False
    for other, group in turned.groupby("other", sort=False):
        s = summarize_pairs(group)
        if s["verdict"] == "busy" or math.isnan(number(s["ratio"])):
            continue
        iv = _iv(s["ratio"], number(s["ratio_ci_low"]), number(s["ratio_ci_high"]))
        if s["verdict"] == "faster":
            matters = True
            parts.append(f"{iv} faster than {other}")
        elif s["verdict"] == "slower":
            matters = True  # the best way's value lost on average: said, not hidden
            parts.append(f"{iv} the speed of {other} (slower)")
        else:
            parts.append(f"the same as {other} ({iv})")
    return matters, f"{factor}={value}: " + ", ".join(parts) if parts else ""


def yours_said(best: dict, mine: dict, times: dict) -> str:
    """Your module against the way to use, paired round by round."""
    name = mine.get("label") or mine.get("variant")
    if mine.get("status") != "ok":
        said = mine.get("diagnosis_says") if mine.get("status") == "mismatch" else None
        error = str(said or mine.get("error") or "").strip().splitlines()
        why = f": {error[0][:160]}" if error and error[0] not in ("", "nan") else ""
        return f"your module {name} is {mine.get('status')}{why}; it was not raced"
    row = effect_row(best, mine, times)  # ratio: the best's time / yours
    ratio, low, high = row["ratio"], row["ratio_ci_low"], row["ratio_ci_high"]
    if row["verdict"] == "busy" or math.isnan(number(ratio)):
        return f"your module {name}: not measured against it, the machine was busy"
    if row["verdict"] == "faster":
        return f"your module {name} is {_iv(ratio, low, high)} faster than it: keep yours"
    if row["verdict"] == "slower":
        return f"your module {name} is {_iv(1 / ratio, 1 / high, 1 / low)} slower than it"
    return f"your module {name} runs at the same speed as it ({_iv(ratio, low, high)})"


def recommendation(
    shape: str, ours: list[dict], mine: list[dict], table: pd.DataFrame, times: dict
) -> str:
    """One shape's sentence: ``ours``, the built-in ways timed there (correct, one row each);
    ``mine``, your ways there (timed, or failed)."""
    if not ours:  # nothing to race against: say what became of yours
        ok = [m for m in mine if m.get("status") == "ok"]
        said = [yours_said({}, m, times) for m in mine if m.get("status") != "ok"]
        if ok:
            fixed = "; ".join(sorted({str(m.get("fixed")) for m in ok if m.get("fixed")}))
            why = f" (it fixes {fixed}: give every way those keys)" if fixed else ""
            said.append(f"no built-in way ran at this shape to race your module against{why}")
        return f"at {shape}: " + "; ".join(said)
    if any(flag(r.get("contended")) for r in ours + mine):
        # what became of a module of yours that failed is no measurement: said on any machine
        failed = [yours_said({}, m, times) for m in mine if m.get("status") != "ok"]
        return (
            f"at {shape}: not decided: the machine was busy during these rounds; re-run on a "
            "quiet machine" + "".join(f"; {said}" for said in failed)
        )
    best = next(r for r in ours if way(r) == rank_shape(ours)["best"])
    speed = number(best.get("speedup"))
    use, pace = way_name(way(best)), ""
    written = [r for r in ours if str(r.get("variant")) != "reference"]
    if not math.isnan(speed) and str(best.get("variant")) != "reference":
        low, high = number(best.get("speedup_ci_low")), number(best.get("speedup_ci_high"))
        pace = f"{_iv(speed, low, high)} nn.MultiheadAttention's speed"
        use += f" ({pace})"
    elif written:  # nn.MHA itself is fastest: how close the best hand-written way came
        top = next(r for r in written if way(r) == rank_shape(written)["best"])
        iv = [number(top.get(k)) for k in ("speedup", "speedup_ci_low", "speedup_ci_high")]
        if not math.isnan(iv[0]):
            use += (
                f" (no way written by hand beat it: the fastest, {way(top)}, {_iv(*iv)} its speed)"
            )
    names = {way(r) for r in ours}
    here = table[
        (table["shape"].astype(str) == str(shape))
        & table["baseline_way"].isin(names)
        & table["alternative_way"].isin(names)
    ]
    varied = [
        f
        for f in factors(best)
        if f not in MODEL_KEYS and len({factors(r).get(f) for r in ours}) > 1
    ]
    said = {f: factor_said(best, f, here) for f in varied}
    matter = [text for f, (m, text) in said.items() if m and text]
    same = [f for f, (m, text) in said.items() if not m and text]
    chosen = " ".join(f"{f}={factors(best)[f]}" for f, (m, t) in said.items() if m and t)
    # the factors that matter lead where others tie: a re-run may pick another of the tied ways
    measured = f"{way_name(way(best))}, {pace}" if pace else use
    text = f"at {shape}: use {chosen} (the fastest measured: {measured})" if chosen and same else ""
    text = text or f"at {shape}: use {use}"
    if matter:
        text += "; " + "; ".join(matter)
    if same:
        word = "makes" if len(same) == 1 else "make"
        text += f"; {' and '.join(same)} {word} no difference here"
    return text + "; " + "; ".join(yours_said(best, m, times) for m in mine)


def race_findings(rows: pd.DataFrame, timed: pd.DataFrame, table: pd.DataFrame, times: dict):
    """A recommendation per shape that has a way of yours: ``rows``, every row ``prepare``d;
    ``timed``, the correct timed ones (results.timed_ok); ``table``, effects.csv's pairs;
    ``times``, effects.round_times."""
    if rows.empty or "variant_target" not in rows.columns:
        return []
    out = []
    for shape, group in rows.groupby("shape", sort=False):
        ok = timed[timed["shape"] == shape].to_dict("records")
        failed = [r for r in group.to_dict("records") if r.get("status") != "ok" and yours(r)]
        mine = [r for r in ok if yours(r)] + failed
        if mine and ok:  # nothing timed here (check_only): nothing raced, no recommendation
            out.append(
                recommendation(str(shape), [r for r in ok if not yours(r)], mine, table, times)
            )
        elif failed and not timed.empty:  # refused before it ran (a module that does not
            # import: its device never resolved, so its shape is no timed one's): said alone
            said = "; ".join(yours_said({}, m, times) for m in failed)
            out.append(f"at {shape}: {said}")
    return out
