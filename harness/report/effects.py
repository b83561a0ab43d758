"""Effects: what each choice of how to write attention does, with its interval, and findings.

A way of writing attention is a set of choices (docs/architecture.md, "Effects and findings"):
its structure (the variant: separate, fused, packed, reference), each option of the variant
(``attention=manual|sdpa|flex``, ``merge=view|reshape``, or an option of your own), ``compile``
and ``sdpa_backend``. Two correct timed ways at one shape whose choices differ in exactly one
make a pair, and the pair's effect is

    ratio = baseline time / alternative time    (above 1: the alternative is faster)

paired round by round: both ways were timed in the same round of the same run at the same shape,
a fraction of a second apart (harness/measure/rounds.py), so the machine's drift cancels as it
does for a speedup over nn.MultiheadAttention. The per-round times come from the rounds' journal
(harness/measure/journal.py); the interval is ``stats.paired_ratio`` with the rows' between-run
floor (``rerun_noise``). With no journal (a results.csv copied alone) the effect is the ratio of
the two rows' speedups with their intervals combined (``basis=speedups``: wider, still honest).

``effects.csv`` has a row per pair and shape; ``effects_summary.csv`` sums each comparison up
over the pairs (all of them, and split by each shape key and other choice that varies): the
geometric mean with a Student-t interval over the pairs' log ratios plus the floor, the range,
and how many pairs were faster, tied, slower. harness/report/findings.py turns them into
sentences.
"""

from __future__ import annotations

import json
import math
from itertools import combinations
from pathlib import Path

import pandas as pd

from harness.config import RERUN_NOISE, choices_of, keys_with
from harness.measure import stats
from harness.measure.journal import JOURNAL_FILE, Journal
from harness.results import JOBS_FILE, SHAPE_KEYS, atomic_write_text, number, timed_ok, way
from harness.schema import EFFECT, SUMMARY

CHOICES = choices_of()
EFFECTS_FILE = "effects.csv"
SUMMARY_FILE = "effects_summary.csv"

# Which value of a choice is the baseline of a pair: the first of these that the pair has (values
# not listed come after, alphabetically). The textbook way first, so that ratios read as "what
# the other way buys".
BASELINE_FIRST = {
    "structure": ["reference", "separate", "fused", "packed"],
    "attention": ["manual", "sdpa", "flex"],
    "merge": ["view", "reshape"],
    # the config's ways of running one module, in the order its choices list them
    **{k: list(CHOICES[k]) for k in ("compile", "sdpa_backend", "kv_cache")},
    "mask": ["causal"],  # against a sliding window (MODEL_KEYS)
}
# What the model computes rather than how it is written: fewer K/V heads (grouped-query) and a
# sliding window instead of full causal attention. Pairs of the same way that differ in one of
# these say what the model's choice buys; nn.MultiheadAttention is left out of them (it computes
# every K/V head, repeated per group).
MODEL_KEYS = ("num_kv_heads", "mask")
CHOICE_ORDER = [*BASELINE_FIRST, "num_kv_heads"]  # findings: the mission's questions first
# Shape keys a summary is split by when they vary: these first (most telling), then every other
# shape key (harness/config.py's roles), so that a new key is split by too. The model's keys and
# the window are choices of a pair, not splits.
SPLIT_FIRST = ["seq_len", "kv_cache_len", "dtype", "mask", "num_heads", "batch", "embed_dim"]
SPLIT_KEYS = [
    *SPLIT_FIRST,
    *(k for k in keys_with("shape") if k not in (*SPLIT_FIRST, *MODEL_KEYS, "window")),
]


def choices(row: dict) -> dict[str, str]:
    """A row's way as its choices: structure, the variant's options, compile, SDPA pin, KV cache
    (decode); and the model's MODEL_KEYS: K/V heads, mask (``sliding:W`` with its window)."""
    out = {"structure": str(row.get("variant"))}
    for part in str(_text(row.get("variant_options"), "")).split():
        key, _, value = part.partition("=")
        if key:
            out[key] = value
    out["compile"] = str(_text(row.get("compile"), "off"))
    out["sdpa_backend"] = str(_text(row.get("sdpa_backend"), "auto"))
    cache = str(_text(row.get("kv_cache"), ""))
    if cache:
        out["kv_cache"] = cache
    heads = number(row.get("num_kv_heads"))
    heads = heads if not math.isnan(heads) else number(row.get("num_heads"))  # older rows
    if not math.isnan(heads):
        out["num_kv_heads"] = str(int(heads))
    mask, window = _text(row.get("mask"), ""), number(row.get("window"))
    if mask:
        out["mask"] = f"sliding:{int(window)}" if mask == "sliding" and window == window else mask
    return out


def _text(value, default: str):
    return default if value is None or (isinstance(value, float) and math.isnan(value)) else value


def _order(choice: str, value: str) -> tuple:
    if choice == "num_kv_heads":  # every head its own K/V first: "what grouping buys"
        return (-int(value), "")
    known = BASELINE_FIRST.get(choice, [])
    return (known.index(value), "") if value in known else (len(known), value)


def differs_in_one(a: dict, b: dict) -> str | None:
    """The one choice in which two ways differ, or None (none, several, or not the same kind of
    way: nn.MultiheadAttention has no options, so it pairs only with itself compiled or pinned).
    Of the model's keys, only K/V heads and causal against a sliding window, and never for
    nn.MultiheadAttention."""
    if a.keys() != b.keys():
        return None
    diff = [k for k in a if a[k] != b[k]]
    if len(diff) != 1:
        return None
    if diff[0] in MODEL_KEYS:
        if a["structure"] == "reference":
            return None
        if diff[0] == "mask" and sorted(v.split(":")[0] for v in (a["mask"], b["mask"])) != [
            "causal",
            "sliding",
        ]:
            return None
    return diff[0]


# -- the rounds each row was timed in ------------------------------------------------------------


def round_times(root: Path | None, df: pd.DataFrame) -> dict[str, dict[tuple, float]]:
    """config_hash -> {(run, round): ms}: each row's repetitions from the rounds' journal (the
    sweep's, or its job's own when the job timed its point alone). Empty without jobs.json."""
    if root is None or not (root / JOBS_FILE).exists():
        return {}
    try:
        jobs = json.loads((root / JOBS_FILE).read_text())["jobs"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    wanted = set(df["config_hash"].astype(str)) if "config_hash" in df.columns else set()
    sweep = Journal(root / JOURNAL_FILE)
    out: dict[str, dict[tuple, float]] = {}
    for job in jobs:
        h = str(job.get("config_hash"))
        if h not in wanted:
            continue
        samples = sweep.load(f"{job['dir']}:{h}")
        if not samples:
            samples = Journal(root / job["dir"] / JOURNAL_FILE).load(f"point:{h}")
        if samples:
            out[h] = {(s.run, s.round): s.ms for s in samples}  # the latest per round
    return out


def _floor(a: dict, b: dict) -> float:
    values = [number(r.get("rerun_noise")) for r in (a, b)]
    values = [v for v in values if not math.isnan(v)]
    if values:
        return max(values)
    return RERUN_NOISE["cuda" if str(a.get("device")).startswith("cuda") else "cpu"]


def pair_effect(base: dict, alt: dict, times: dict) -> tuple[stats.Interval, int, str]:
    """(ratio interval, rounds paired, basis) of baseline time / alternative time."""
    floor = _floor(base, alt)
    mine, theirs = times.get(str(base.get("config_hash"))), times.get(str(alt.get("config_hash")))
    if mine and theirs:
        common = sorted(set(mine) & set(theirs))
        if len(common) >= 2:
            iv = stats.paired_ratio([mine[k] for k in common], [theirs[k] for k in common], floor)
            return iv, len(common), "rounds"
    triples = [
        tuple(number(r.get(c)) for c in ("speedup", "speedup_ci_low", "speedup_ci_high"))
        for r in (base, alt)
    ]
    if all(not math.isnan(t[0]) for t in triples):
        return stats.ratio_of_intervals(triples[0], triples[1]), 0, "speedups"
    return stats.NAN, 0, ""


def verdict(low: float, high: float) -> str:
    if math.isnan(low) or math.isnan(high):
        return "tie"  # no interval: it cannot be told apart from 1
    return "faster" if low > 1 else "slower" if high < 1 else "tie"


# -- effects.csv ----------------------------------------------------------------------------------


def effects(df: pd.DataFrame, root: Path | None = None) -> pd.DataFrame:
    """One row per pair of correct timed ways that differ in one choice, at each shape."""
    from harness.report.ranking import shape_labels  # the report's own shape labels

    columns = [c.name for c in EFFECT[:4]] + SHAPE_KEYS + [c.name for c in EFFECT[4:]]
    ok = timed_ok(df)
    if ok.empty:
        return pd.DataFrame(columns=columns)
    ok = ok.assign(shape=shape_labels(ok))
    times = round_times(root, ok)
    keys = [k for k in SHAPE_KEYS if k in ok.columns and k not in (*MODEL_KEYS, "window")]
    out = []
    for _, group in ok.groupby([ok[k].astype(str) for k in keys], sort=False, dropna=False):
        rows = group.to_dict("records")
        ways = [choices(r) for r in rows]
        for (i, a), (j, b) in combinations(enumerate(ways), 2):
            choice = differs_in_one(a, b)
            if choice is None:
                continue
            if _order(choice, b[choice]) < _order(choice, a[choice]):
                i, j, a, b = j, i, b, a
            base, alt = rows[i], rows[j]
            iv, n, basis = pair_effect(base, alt, times)
            if not basis:
                continue
            context = " ".join(f"{k}={v}" for k, v in a.items() if k != choice)
            out.append(
                {
                    "choice": choice,
                    "baseline": a[choice],
                    "alternative": b[choice],
                    "context": context,
                    **{k: base.get(k) for k in SHAPE_KEYS if k in base},
                    "shape": base["shape"],
                    "ratio": iv.center,
                    "ratio_ci_low": iv.low,
                    "ratio_ci_high": iv.high,
                    "verdict": verdict(iv.low, iv.high),
                    "n_pairs": n,
                    "basis": basis,
                    "baseline_way": way(base),
                    "alternative_way": way(alt),
                    "baseline_ms": number(base.get("latency_ms_median")),
                    "alternative_ms": number(alt.get("latency_ms_median")),
                    "baseline_mem_mb": number(base.get("peak_mem_mb")),
                    "alternative_mem_mb": number(alt.get("peak_mem_mb")),
                    "rerun_noise": _floor(base, alt),
                }
            )
    if not out:
        return pd.DataFrame(columns=columns)
    table = pd.DataFrame(out).reindex(columns=columns)
    order = table.apply(
        lambda r: (
            CHOICE_ORDER.index(r["choice"]) if r["choice"] in CHOICE_ORDER else len(CHOICE_ORDER),
            r["choice"],
            _order(r["choice"], r["baseline"]),
            _order(r["choice"], r["alternative"]),
        ),
        axis=1,
    )
    return table.loc[sorted(table.index, key=lambda i: order[i])].reset_index(drop=True)


# -- effects_summary.csv -------------------------------------------------------------------------


def summarize_pairs(pairs: pd.DataFrame) -> dict:
    """The geometric mean of ``pairs``' ratios with its interval, range and verdict counts."""
    ratios = pd.to_numeric(pairs["ratio"], errors="coerce").dropna()
    ratios = ratios[ratios > 0]
    counts = pairs["verdict"].value_counts()
    if len(ratios) == 1:  # one pair: its own interval
        row = pairs.loc[ratios.index[0]]
        iv = stats.Interval(float(row["ratio"]), row["ratio_ci_low"], row["ratio_ci_high"], 1)
    else:
        # A re-run moves every pair of the run together: the floor does not shrink with their
        # number, so it is added once, as under one pair.
        floor = pd.to_numeric(pairs["rerun_noise"], errors="coerce").max()
        iv = stats.log_interval(list(ratios), 0.0 if math.isnan(floor) else floor)
    return {
        "n": int(len(ratios)),
        "ratio": iv.center,
        "ratio_ci_low": number(iv.low),
        "ratio_ci_high": number(iv.high),
        "ratio_min": float(ratios.min()) if len(ratios) else math.nan,
        "ratio_max": float(ratios.max()) if len(ratios) else math.nan,
        "faster": int(counts.get("faster", 0)),
        "ties": int(counts.get("tie", 0)),
        "slower": int(counts.get("slower", 0)),
        "verdict": verdict(number(iv.low), number(iv.high)),
    }


def summarize(table: pd.DataFrame) -> pd.DataFrame:
    """Each comparison over its pairs, then split by each shape key and other choice that
    varies among them."""
    columns = [c.name for c in SUMMARY]
    if table.empty:
        return pd.DataFrame(columns=columns)
    out = []
    for (choice, base, alt), pairs in table.groupby(
        ["choice", "baseline", "alternative"], sort=False
    ):
        head = {"choice": choice, "baseline": base, "alternative": alt}
        out.append({**head, "by": "all", "value": "", **summarize_pairs(pairs)})
        for by, values in splits(pairs):
            for value, part in pairs.groupby(values, sort=False, dropna=False):
                if value in ("", "nan"):  # ways without that option (nn.MHA), or that key
                    # (a prefill's kv_cache_len): their own split says them
                    continue
                out.append({**head, "by": by, "value": str(value), **summarize_pairs(part)})
    return pd.DataFrame(out, columns=columns)


def _same_partition(a: pd.Series, b: pd.Series) -> bool:
    both = pd.DataFrame({"a": a, "b": b}).drop_duplicates()
    return len(both) == a.nunique() == b.nunique()


def splits(pairs: pd.DataFrame) -> list[tuple[str, pd.Series]]:
    """(key, each pair's value) for every shape key and other choice that varies in ``pairs``."""
    out: list[tuple[str, pd.Series]] = []
    for key in SPLIT_KEYS:
        values = pairs[key].astype(str).fillna("nan") if key in pairs.columns else None
        if values is None or values.nunique() < 2:  # a prefill's kv_cache_len: "nan"
            continue
        # a key that splits the pairs as an earlier one does says nothing new (a decode's
        # kv_seq_len is its kv_cache_len + seq_len)
        if not any(_same_partition(values, earlier) for _, earlier in out):
            out.append((key, values))
    contexts = [dict(p.split("=", 1) for p in str(c).split()) for c in pairs["context"]]
    keys = list(dict.fromkeys(k for c in contexts for k in c))  # nn.MHA's lack the options
    split = {k for k, _ in out}
    for key in (k for k in keys if k not in split):  # a model key (mask) is a shape key too
        values = pd.Series([c.get(key, "") for c in contexts], index=pairs.index)
        if values.nunique() > 1:
            out.append((key, values))
    return out


def write(root: Path, df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """effects.csv and effects_summary.csv under ``root``, from its rows and rounds' journal."""
    table = effects(df, root)
    summary = summarize(table)
    atomic_write_text(root / EFFECTS_FILE, table.to_csv(index=False))
    atomic_write_text(root / SUMMARY_FILE, summary.to_csv(index=False))
    return table, summary
