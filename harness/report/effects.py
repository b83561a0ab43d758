"""Effects: what each factor of how to write attention does, with its interval, and findings.

A way of writing attention is a set of factors (docs/architecture.md, "Effects and findings"):
its structure (the variant: separate, fused, packed, reference), each option of the variant
(``attention=manual|sdpa|flex``, ``merge=view|reshape``, or an option of your own), ``compile``
and ``sdpa_backend``. Two correct timed ways at one shape whose factors differ in exactly one
make a pair, and the pair's effect is

    ratio = baseline time / alternative time    (above 1: the alternative is faster)

paired round by round: both ways were timed in the same round of the same run at the same shape,
a fraction of a second apart (harness/measure/rounds.py), so the machine's drift cancels as it
does for a speedup over nn.MultiheadAttention. The per-round times come from the rounds' journal
(harness/measure/journal.py); the interval is ``stats.paired_ratio`` with the rows' between-run
floor (``rerun_noise``). With no journal (a results.csv copied alone) the effect is the ratio of
the two rows' speedups with their intervals combined (``basis=speedups``: wider, still honest).

``effects.csv`` has a row per pair and shape; ``effects_summary.csv`` sums each comparison up
over the pairs (all of them, and split by each shape key and other factor that varies): the
geometric mean with a Student-t interval over the pairs' log ratios plus the floor, the range,
and how many pairs were faster, tied, slower. harness/report/findings.py turns them into
sentences.

On CUDA a row's latency is device time (its call replayed from a CUDA graph) and the row also
carries the eager call time a Python caller waits (``eager_ms_*``, ``eager_speedup*``): a pair's
``eager_ratio`` is the same ratio of those, from the two rows' eager speedups. A pair whose ways
ran different kernels where the factor does not choose the kernel (``kernel_change``: Inductor
turned compiled manual attention into cuDNN SDPA) is summed up apart from the pairs that ran the
same kernel, so that the kernel's speed is not read as the factor's.

A pair either of whose rows stayed contended by other processes (``contended``:
harness/report/busy.py) gets the verdict ``busy`` whatever its ratio, and is left out of every
summary's statistics (the summary's ``busy`` counts it); a comparison whose every pair is busy
gets the verdict ``busy``. Repetitions the journal marks ``contended`` (re-timed in a later
round) are never paired.
"""

from __future__ import annotations

import json
import math
from itertools import combinations
from pathlib import Path

import pandas as pd

from harness.config import choices_of, keys_with, rerun_floor
from harness.measure import stats
from harness.measure.journal import JOURNAL_FILE, Journal
from harness.results import (  # noqa: F401 (factors: imported from here too)
    JOBS_FILE,
    SHAPE_KEYS,
    atomic_write_text,
    factors,
    number,
    text_or,
    timed_ok,
    way,
)
from harness.report.busy import flag
from harness.report.ranking import shape_labels
from harness.report.ways import Ways
from harness.report.ways import load as load_ways
from harness.schema import EFFECT, SUMMARY

CHOICES = choices_of()
EFFECTS_FILE = "effects.csv"
SUMMARY_FILE = "effects_summary.csv"
# Which value of a factor is the baseline of a pair: the first of these that the pair has (values
# not listed come after, alphabetically). The textbook way first, so that ratios read as "what
# the other way buys".
BASELINE_FIRST = {
    "structure": ["reference", "separate", "fused", "packed"],
    "attention": [],  # by the run's kernels' own order (ways.json: Kernel.order), then name
    "merge": ["view", "reshape"],
    # the config's ways of running one module, in the order its factors list them
    **{k: list(CHOICES[k]) for k in ("compile", "sdpa_backend", "kv_cache")},
    "mask": ["causal"],  # against a sliding window (MODEL_KEYS)
}
# What the model computes rather than how it is written (the keys of role ``model``: fewer K/V
# heads, a sliding window instead of full causal attention). Pairs of the same way that differ in
# one of these say what the model's factor buys; nn.MultiheadAttention is left out of them (it
# computes every K/V head, repeated per group).
MODEL_KEYS = keys_with("model")
FACTOR_ORDER = [*BASELINE_FIRST, "num_kv_heads"]  # findings: the mission's questions first
# Shape keys a summary is split by when they vary: these first (most telling), then every other
# shape key (harness/config.py's roles), so that a new key is split by too. The model's keys and
# the window are factors of a pair, not splits.
SPLIT_FIRST = ["seq_len", "kv_cache_len", "dtype", "mask", "num_heads", "batch", "embed_dim"]
SPLIT_KEYS = [
    *SPLIT_FIRST,
    *(k for k in keys_with("shape") if k not in (*SPLIT_FIRST, "window")),
]


# The factors that choose the attention kernel themselves: a pair of them runs two kernels by
# design. In any other factor's pair a kernel change is a swap (``kernel_change``).
KERNEL_FACTORS = ("attention", "sdpa_backend")


def _order(factor: str, value: str, ways: Ways) -> tuple:
    if factor == "num_kv_heads":  # every head its own K/V first: "what grouping buys"
        return (-int(value), "")
    if factor == "attention":
        return (ways.kernel_order(value), value)
    known = BASELINE_FIRST.get(factor, [])
    return (known.index(value), "") if value in known else (len(known), value)


def differs_in_one(a: dict, b: dict) -> str | None:
    """The one factor in which two ways differ, or None (none, several, or not the same kind of
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
    sweep's, or its job's own when the job timed its point alone), less those contention
    spoiled (``Sample.contended``: re-timed in a later round). Empty without jobs.json."""
    if root is None or not (root / JOBS_FILE).exists():
        return {}
    try:
        jobs = json.loads((root / JOBS_FILE).read_text())["jobs"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    wanted = set(df["config_hash"].astype(str)) if "config_hash" in df.columns else set()
    lost = "the effects' per-round pairs leave those repetitions out"
    sweep = Journal(root / JOURNAL_FILE, lost)
    out: dict[str, dict[tuple, float]] = {}
    for job in jobs:
        h = str(job.get("config_hash"))
        if h not in wanted:
            continue
        samples = sweep.load(f"{job['dir']}:{h}")
        if not samples:
            samples = Journal(root / job["dir"] / JOURNAL_FILE, lost).load(f"point:{h}")
        clean = [s for s in samples if not getattr(s, "contended", False)]
        if clean:
            out[h] = {(s.run, s.round): s.ms for s in clean}  # the latest per round
    return out


def _floor(a: dict, b: dict) -> float:
    values = [number(r.get("rerun_noise")) for r in (a, b)]
    values = [v for v in values if not math.isnan(v)]
    if values:
        return max(values)
    # rows without the column (older files): the device kind's earned (or assumed) floor
    return rerun_floor(str(a.get("device")))[0]


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


def busy(*rows: dict) -> bool:
    """Whether any of the rows stayed contended (timed on a busy machine): its pairs decide
    nothing."""
    return any(flag(r.get("contended")) for r in rows)


def direction(low: float, high: float) -> str:
    """Which way a ratio's interval points: faster (above 1), slower (below 1) or tie."""
    if math.isnan(low) or math.isnan(high):
        return "tie"  # no interval: it cannot be told apart from 1
    return "faster" if low > 1 else "slower" if high < 1 else "tie"


def effect_row(base: dict, alt: dict, times: dict) -> dict:
    """What pairing two ways at one shape measured (a row of effects.csv, and of paired.csv):
    the shape, ratio = base time / alt time with its 95% interval and verdict (``busy`` where
    either row stayed contended: its figures are what was measured and decide nothing), the
    rounds paired and the basis ("rounds", "speedups", or empty: nothing to pair), the ways,
    their latencies and peak memory, and the re-run floor the interval includes."""
    iv, n, basis = pair_effect(base, alt, times)
    return {
        **{k: base.get(k) for k in SHAPE_KEYS if k in base},
        "shape": base.get("shape"),
        "ratio": iv.center,
        "ratio_ci_low": iv.low,
        "ratio_ci_high": iv.high,
        "verdict": "busy" if busy(base, alt) else direction(iv.low, iv.high),
        "n_pairs": n,
        "basis": basis,
        "baseline_way": way(base),
        "alternative_way": way(alt),
        "baseline_ms": number(base.get("latency_ms_median")),
        "alternative_ms": number(alt.get("latency_ms_median")),
        "baseline_mem_mb": number(base.get("peak_mem_mb")),
        "alternative_mem_mb": number(alt.get("peak_mem_mb")),
        "rerun_noise": _floor(base, alt),
        "baseline_kernel": _kernel(base),
        "alternative_kernel": _kernel(alt),
        "baseline_eager_ms": number(base.get("eager_ms_median")),
        "alternative_eager_ms": number(alt.get("eager_ms_median")),
        **dict(zip(EAGER_RATIO, eager_effect(base, alt))),
    }


EAGER_RATIO = ("eager_ratio", "eager_ratio_ci_low", "eager_ratio_ci_high")


def _kernel(row: dict) -> str:
    """The row's ``sdpa_kernel`` as text (empty where it was not recorded)."""
    return str(text_or(row.get("sdpa_kernel"), "")).strip()


def kernel_change(factor: str, base: dict, alt: dict) -> str:
    """``base->alt`` kernels where the two ways ran different attention kernels and ``factor``
    is not the kernel's own choice (KERNEL_FACTORS); empty otherwise, or where one is unknown."""
    a, b = _kernel(base), _kernel(alt)
    if factor in KERNEL_FACTORS or not a or not b or a == b:
        return ""
    return f"{a}->{b}"


def eager_effect(base: dict, alt: dict) -> tuple[float, float, float]:
    """(ratio, low, high) of base's eager call time / alt's: the two rows' eager speedups over
    nn.MHA divided (both paired with nn.MHA round by round), their intervals combined; or their
    eager times' own intervals where a row has no eager speedup. NaN on the CPU (no eager
    times)."""
    for columns in (
        ("eager_speedup", "eager_speedup_ci_low", "eager_speedup_ci_high"),
        ("eager_ms_median", "eager_ms_ci_low", "eager_ms_ci_high"),
    ):
        triples = [tuple(number(r.get(c)) for c in columns) for r in (base, alt)]
        if all(not math.isnan(t[0]) and t[0] > 0 for t in triples):
            if columns[0] == "eager_ms_median":  # a time: base / alt, not alt / base
                triples.reverse()
            iv = stats.ratio_of_intervals(triples[0], triples[1])
            return iv.center, number(iv.low), number(iv.high)
    return math.nan, math.nan, math.nan


# -- effects.csv ----------------------------------------------------------------------------------


def effects(df: pd.DataFrame, root: Path | None = None, ways: Ways | None = None) -> pd.DataFrame:
    """One row per pair of correct timed ways that differ in one factor, at each shape (``df``:
    any rows; ``pairs`` when they are the correct timed rows already)."""
    ok = timed_ok(df)
    return pairs(ok if "shape" in ok.columns else ok.assign(shape=shape_labels(ok)), root, ways)


def pairs(ok: pd.DataFrame, root: Path | None = None, ways: Ways | None = None) -> pd.DataFrame:
    """``effects`` of the correct timed rows (``results.timed_ok``) labelled with their
    ``shape`` (``ranking.shape_labels``). Of two kernels the baseline is the lower in ``ways``'
    order (default: ``root``'s ways.json)."""
    ways = load_ways(root) if ways is None else ways
    columns = [c.name for c in EFFECT[:4]] + SHAPE_KEYS + [c.name for c in EFFECT[4:]]
    if ok.empty:
        return pd.DataFrame(columns=columns)
    times = round_times(root, ok)
    keys = [k for k in SHAPE_KEYS if k in ok.columns and k not in (*MODEL_KEYS, "window")]
    out = []
    for _, group in ok.groupby([ok[k].astype(str) for k in keys], sort=False, dropna=False):
        rows = group.to_dict("records")
        written = [factors(r) for r in rows]  # each way by its factors
        for (i, a), (j, b) in combinations(enumerate(written), 2):
            factor = differs_in_one(a, b)
            if factor is None:
                continue
            if _order(factor, b[factor], ways) < _order(factor, a[factor], ways):
                i, j, a, b = j, i, b, a
            row = effect_row(rows[i], rows[j], times)
            if not row["basis"] and row["verdict"] != "busy":  # a busy pair is counted anyway
                continue
            context = " ".join(f"{k}={v}" for k, v in a.items() if k != factor)
            head = {"factor": factor, "baseline": a[factor], "alternative": b[factor]}
            change = kernel_change(factor, rows[i], rows[j])
            out.append({**head, "context": context, **row, "kernel_change": change})
    if not out:
        return pd.DataFrame(columns=columns)
    table = pd.DataFrame(out).reindex(columns=columns)
    order = table.apply(
        lambda r: (
            FACTOR_ORDER.index(r["factor"]) if r["factor"] in FACTOR_ORDER else len(FACTOR_ORDER),
            r["factor"],
            _order(r["factor"], r["baseline"], ways),
            _order(r["factor"], r["alternative"], ways),
        ),
        axis=1,
    )
    return table.loc[sorted(table.index, key=lambda i: order[i])].reset_index(drop=True)


# -- effects_summary.csv -------------------------------------------------------------------------


# A summary of no pair that could be measured (every one busy).
NOTHING = {
    "n": 0,
    **dict.fromkeys(("ratio", "ratio_ci_low", "ratio_ci_high", "ratio_min", "ratio_max"), math.nan),
    **dict.fromkeys(("faster", "ties", "slower"), 0),
    **dict.fromkeys(("eager_ratio", "eager_ratio_ci_low", "eager_ratio_ci_high"), math.nan),
    "eager_verdict": "",
}


def summarize_pairs(pairs: pd.DataFrame, pooled: bool = False) -> dict:
    """The geometric mean of ``pairs``' ratios with its interval, range and verdict counts. The
    interval is the spread between the pairs (what the factor does across contexts: few pairs
    that differ give a wide one), or with ``pooled`` their own intervals combined
    (``stats.pooled``: the mean over exactly these pairs, as ``mha-bench paired`` reports it).
    Busy pairs (verdict ``busy``) are left out of all of it and counted (``busy``); when every
    pair is busy the verdict is ``busy``."""
    is_busy = pairs["verdict"].astype(str) == "busy"
    left_out = int(is_busy.sum())
    pairs = pairs[~is_busy]
    if left_out and pairs.empty:
        return {**NOTHING, "verdict": "busy", "busy": left_out}
    ratios = pd.to_numeric(pairs["ratio"], errors="coerce").dropna()
    ratios = ratios[ratios > 0]
    counts = pairs["verdict"].value_counts()
    # A re-run moves every pair of the run together: the floor does not shrink with their
    # number, so it is added once, as under one pair.
    floor = pd.to_numeric(pairs["rerun_noise"], errors="coerce").max()
    floor = 0.0 if math.isnan(floor) else floor
    if len(ratios) == 1:  # one pair: its own interval
        row = pairs.loc[ratios.index[0]]
        iv = stats.Interval(float(row["ratio"]), row["ratio_ci_low"], row["ratio_ci_high"], 1)
    elif pooled:
        bounds = pairs.loc[ratios.index, ["ratio", "ratio_ci_low", "ratio_ci_high"]]
        iv = stats.pooled([tuple(map(number, r)) for r in bounds.itertuples(index=False)], floor)
    else:
        iv = stats.log_interval(list(ratios), floor)
    eager = _mean(pairs, EAGER_RATIO, pooled, floor)
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
        "verdict": direction(number(iv.low), number(iv.high)),
        "eager_ratio": eager.center,
        "eager_ratio_ci_low": number(eager.low),
        "eager_ratio_ci_high": number(eager.high),
        "eager_verdict": direction(number(eager.low), number(eager.high))
        if not math.isnan(number(eager.center))
        else "",
        "busy": left_out,
    }


def _mean(pairs: pd.DataFrame, columns: tuple[str, str, str], pooled: bool, floor: float):
    """The geometric mean of ``columns`` (ratio, low, high) over the pairs that have it, as
    ``summarize_pairs`` takes the ratios' (NaN where none has it: CPU rows have no eager time)."""
    if columns[0] not in pairs.columns:
        return stats.NAN
    bounds = pairs[list(columns)].apply(pd.to_numeric, errors="coerce")
    bounds = bounds[bounds[columns[0]] > 0]
    if bounds.empty:
        return stats.NAN
    if len(bounds) == 1:
        return stats.Interval(*map(float, bounds.iloc[0]), 1)
    if pooled:
        return stats.pooled([tuple(r) for r in bounds.itertuples(index=False)], floor)
    return stats.log_interval(list(bounds[columns[0]]), floor)


def summarize(table: pd.DataFrame) -> pd.DataFrame:
    """Each comparison over its pairs, then split by each shape key and other factor that
    varies among them."""
    columns = [c.name for c in SUMMARY]
    if table.empty:
        return pd.DataFrame(columns=columns)
    out = []
    changes = kernel_changes(table)
    for (factor, base, alt), comparison in table.groupby(
        ["factor", "baseline", "alternative"], sort=False
    ):
        # the pairs that ran the same kernel first, then each kernel swap apart
        swaps = changes[comparison.index]
        for change in sorted(set(swaps), key=lambda c: (c != "", c)):
            pairs = comparison[swaps == change]
            head = {"factor": factor, "baseline": base, "alternative": alt, "kernel_change": change}
            out.append({**head, "by": "all", "value": "", **summarize_pairs(pairs)})
            for by, values in splits(pairs):
                for value, part in pairs.groupby(values, sort=False, dropna=False):
                    if value in ("", "nan"):  # ways without that option (nn.MHA), or that key
                        # (a prefill's kv_cache_len): their own split says them
                        continue
                    out.append({**head, "by": by, "value": str(value), **summarize_pairs(part)})
    return pd.DataFrame(out, columns=columns)


def kernel_changes(table: pd.DataFrame) -> pd.Series:
    """Each pair's ``kernel_change`` as text, empty where none (or an effects.csv from before the
    column)."""
    if "kernel_change" not in table.columns:
        return pd.Series("", index=table.index)
    return table["kernel_change"].map(lambda v: str(text_or(v, "")).strip())


def _same_partition(a: pd.Series, b: pd.Series) -> bool:
    both = pd.DataFrame({"a": a, "b": b}).drop_duplicates()
    return len(both) == a.nunique() == b.nunique()


def splits(pairs: pd.DataFrame) -> list[tuple[str, pd.Series]]:
    """(key, each pair's value) for every shape key and other factor that varies in ``pairs``."""
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


def write(
    root: Path, df: pd.DataFrame, ways: Ways | None = None
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """effects.csv and effects_summary.csv under ``root``, from its rows and rounds' journal."""
    table = effects(df, root, ways)
    summary = summarize(table)
    atomic_write_text(root / EFFECTS_FILE, table.to_csv(index=False))
    atomic_write_text(root / SUMMARY_FILE, summary.to_csv(index=False))
    return table, summary
