"""Findings: the effects (harness/report/effects.py), the ranking and the decode rows in
sentences, in the mission's order ("a fused QKV is 1.08x [1.05, 1.11] faster here; view vs
reshape: no difference"). The statistics are effects.py's; this module only says them.
"""

from __future__ import annotations

import math

import pandas as pd

from harness.report.ways import Ways, way_name
from harness.results import number, timed_ok, way

# How findings name the structures and kernels: the run's ways.json (harness/report/ways.py),
# written from their own definitions when the run ended.
BY_VALUE = Ways()  # without it: ways named by their values


# -- findings -------------------------------------------------------------------------------------


# A tie is stated as "the same speed within N%" up to this bound; a wider interval is "cannot be
# told apart", which is what it is.
TIE_BOUND = 25


def _x(value: float) -> str:
    return f"{value:.2f}x" if value < 10 else f"{value:.0f}x"


def _iv(row) -> str:
    low, high = number(row["ratio_ci_low"]), number(row["ratio_ci_high"])
    if math.isnan(low) or math.isnan(high):
        return _x(row["ratio"]) + " (no interval)"
    return f"{_x(row['ratio'])} [{low:.2f}, {high:.2f}]"


def mixed(row) -> bool:
    """Pairs go both ways, more often than 95% intervals miss by chance (5% of the pairs)."""
    chance = max(1.0, 0.05 * row["n"])
    return row["faster"] > chance and row["slower"] > chance


def _bound(row) -> float:
    """How far from 1 a tie's interval reaches, in percent (inf without a lower bound above 0)."""
    low, high = number(row["ratio_ci_low"]), number(row["ratio_ci_high"])
    return max(high - 1, 1 / low - 1) * 100 if low > 0 else math.inf


def _n(value: float) -> str:
    """An interval's bound, short: 0.01, 0.95, 2.20, 709."""
    return f"{value:.2f}" if value < 10 else f"{value:.0f}"


def _said(row, alt: str, base: str, pairs: str) -> str:
    """The effect of one summary row in words, over ``pairs`` ("52 pairs"): faster, slower,
    mixed, or a tie with its bound, then the pairs' verdicts and range. An interval too wide to
    bound a tie (beyond TIE_BOUND) says that it was not measured well enough, with no ratio and
    no per-pair verdicts to contradict that."""
    counts = (
        f" over {pairs} ({row['faster']} faster, {row['ties']} tied, {row['slower']} slower; "
        f"range {row['ratio_min']:.2f}-{row['ratio_max']:.2f}x{_left_out(row)})"
    )
    if row["verdict"] == "faster":
        return f"{alt} is {_iv(row)} faster than {base}" + counts
    if row["verdict"] == "slower":
        return f"{alt} runs at {_iv(row)} the speed of {base} (slower)" + counts
    if mixed(row):
        return f"{alt} against {base}: no single answer, {_iv(row)}" + counts
    bound = _bound(row)
    if bound <= TIE_BOUND:
        within = math.ceil(round(bound, 6))  # 8.0000001% is "within 8%"
        return f"{alt} and {base} run at the same speed within {within}% ({_iv(row)})" + counts
    low, high = number(row["ratio_ci_low"]), number(row["ratio_ci_high"])
    interval = "no interval," if math.isnan(low) else f"interval {_n(low)}-{_n(high)}x over"
    return (
        f"{alt} and {base} cannot be told apart, not measured well enough ({interval} "
        f"{pairs}{_left_out(row)})"
    )


def _busy(row) -> int:
    """The summary row's pairs left out because the machine was busy (0 before the column)."""
    value = number(row.get("busy"))
    return 0 if math.isnan(value) else int(value)


def _left_out(row) -> str:
    busy = _busy(row)
    return f"; {busy} more left out: the machine was busy" if busy else ""


def _where(rows: pd.DataFrame) -> str:
    """How the effect moves: the split whose groups differ most, when their intervals do not
    overlap (a difference the rounds can tell), as "1.25x at seq_len=128, 1.05x at 1024"."""
    best, spread = None, 0.0
    rows = rows[pd.to_numeric(rows["ratio"], errors="coerce") > 0]  # not all-busy parts
    for by, group in rows.groupby("by", sort=False):
        if by == "all" or len(group) < 2:
            continue
        lo, hi = group.loc[group["ratio"].idxmin()], group.loc[group["ratio"].idxmax()]
        apart = number(lo["ratio_ci_high"]) < number(hi["ratio_ci_low"])
        width = math.log(hi["ratio"] / lo["ratio"]) if lo["ratio"] > 0 else 0
        if apart and width > spread:
            best, spread = group, width
    if best is None:
        return ""
    by = best["by"].iloc[0]
    parts = [f"{_x(r['ratio'])} at {by}={r['value']}" for r in best.to_dict("records")]
    return f"; it depends on {by}: " + ", ".join(parts)


def _eager_said(top, alt: str) -> str:
    """Where the eager call times (CUDA: launches included, what a Python caller waits) give
    another answer than the device times: that answer, with its interval; else empty."""
    verdict = str(top.get("eager_verdict", "") or "")
    if verdict not in ("faster", "slower", "tie") or verdict == top["verdict"]:
        return ""
    eager = {
        "ratio": number(top.get("eager_ratio")),
        "ratio_ci_low": top.get("eager_ratio_ci_low"),
        "ratio_ci_high": top.get("eager_ratio_ci_high"),
    }
    said = {
        "faster": f"{alt} is faster",
        "slower": f"{alt} is slower",
        "tie": "they cannot be told apart",
    }[verdict]
    return f"; in eager call time (launches included, what a Python caller waits) {said}: " + _iv(
        eager
    )


# How a kernel swap names the kernels (a row's sdpa_kernel).
KERNEL_WORDS = {
    "none": "no SDPA kernel",
    "cudnn": "cuDNN SDPA",
    "flash": "flash SDPA",
    "efficient": "memory-efficient SDPA",
    "math": "SDPA's math kernel",
    "cpu_flash": "CPU flash SDPA",
    "flex": "FlexAttention",
}


def _kernels(change: str) -> str:
    """ "none->cudnn" -> "no SDPA kernel -> cuDNN SDPA"."""
    return " -> ".join(
        "+".join(KERNEL_WORDS.get(k, k) for k in side.split("+")) for side in change.split("->")
    )


def _whose(context: dict, ways: Ways) -> str:
    """The ways of one swapped pair, by their kernel, else by their structure (the factor
    compared may be either: then the rest of the pair's context)."""
    if "attention" in context:
        return f"attention={context['attention']}"
    if "structure" in context:
        return ways.name("structure", context["structure"])
    return " ".join(f"{k}={v}" for k, v in context.items()) or "every pair"


def _where_swapped(swapped: pd.DataFrame, pairs: pd.DataFrame, ways: Ways) -> str:
    """Which ways the swap happened to, as "attention=manual mask=none (12), nn.MultiheadAttention
    mask=causal (2)": the pairs by kernel (attention=) or by structure for ways without one, each
    with the shape keys it alone holds fixed among the comparison's pairs."""
    contexts = [dict(p.split("=", 1) for p in str(c).split()) for c in swapped["context"]]
    whose = [_whose(c, ways) for c in contexts]
    whose = pd.Series(whose, index=swapped.index)
    keys = [k for k in ("seq_len", "mask", "dtype", "batch") if k in pairs.columns]
    parts = []
    for who, group in swapped.groupby(whose, sort=False):
        fixed = [
            f"{k}={group[k].iloc[0]}"
            for k in keys
            if group[k].astype(str).nunique() == 1 and pairs[k].astype(str).nunique() > 1
        ]
        parts.append(" ".join([who, *fixed]) + f" ({len(group)})")
    return ", ".join(parts)


def _swapped_where(factor: str, change: str, top, table, ways: Ways) -> str:
    """The ": attention=manual mask=none (12), ..." for a comparison's pairs with kernel ``change``,
    from effects.csv (``table``); empty without it."""
    if table is None or "kernel_change" not in table.columns or table.empty:
        return ""
    mine = table[
        (table["factor"] == factor)
        & (table["baseline"].astype(str) == str(top["baseline"]))
        & (table["alternative"].astype(str) == str(top["alternative"]))
    ]
    swapped = mine[mine["kernel_change"].astype(str) == change]
    return ": " + _where_swapped(swapped, mine, ways) if len(swapped) else ""


def _swapper(factor: str) -> str:
    return "Inductor swapped the kernel" if factor == "compile" else "the kernel changed"


def _swap_said(factor: str, change: str, rows: pd.DataFrame, table, ways: Ways) -> str:
    """A comparison's pairs whose kernel changed (``kernel_change``) beside pairs that ran the
    same kernel: which kernels, where, and what they measured, said as the kernels' doing."""
    top = rows[rows["by"] == "all"].iloc[0]
    if top["verdict"] == "busy":
        return (
            f"{_swapper(factor)} in {_busy(top)} more pairs ({_kernels(change)}"
            f"{_swapped_where(factor, change, top, table, ways)}): not measured, the machine was "
            "busy"
        )
    return (
        f"{_swapper(factor)} in {top['n']} more pairs ({_kernels(change)}"
        f"{_swapped_where(factor, change, top, table, ways)}): {_iv(top)} there, which compares "
        f"kernels, not {ways.name(factor, str(top['alternative']))} alone"
    )


def findings(
    summary: pd.DataFrame, table: pd.DataFrame | None = None, ways: Ways = BY_VALUE
) -> list[dict]:
    """A sentence per comparison, in the mission's order: ``{"factor", "text", "verdict"}``.
    Pairs whose kernel changed (the summary's ``kernel_change``: Inductor swapped manual
    attention for cuDNN SDPA) are said apart, as the kernels' doing; ``table`` (effects.csv)
    says which ways they were; ``ways`` how to name them (the run's ways.json)."""
    out = []
    if summary.empty:
        return out
    changes = (
        summary["kernel_change"].map(lambda v: "" if v is None or v != v else str(v))
        if "kernel_change" in summary.columns
        else pd.Series("", index=summary.index)
    )
    for (factor, base, alt), comparison in summary.groupby(
        ["factor", "baseline", "alternative"], sort=False
    ):
        mine = changes[comparison.index]
        swaps = [c for c in dict.fromkeys(mine) if c]
        lead_change = "" if (mine == "").any() else swaps.pop(0)  # every pair swapped: said first
        lead = comparison[mine == lead_change]
        top = lead[lead["by"] == "all"].iloc[0]
        alt_name, base_name = ways.name(factor, alt), ways.name(factor, base)
        kernel = " that ran the same kernel" if swaps and not lead_change else ""
        if top["verdict"] == "busy":  # every pair timed on a busy machine: nothing to say
            text = (
                f"{alt_name} against {base_name}: not measured: the machine was busy for all "
                f"{_busy(top)} pairs{kernel}"
            )
        else:
            text = _said(top, alt_name, base_name, f"{top['n']} pairs{kernel}") + _where(lead)
        if lead_change:
            text += (
                f", but {_swapper(factor)} in every pair ({_kernels(lead_change)}"
                f"{_swapped_where(factor, lead_change, top, table, ways)}): that compares "
                f"kernels, not {alt_name} alone"
            )
        text += _eager_said(top, alt_name)
        said = [_swap_said(factor, c, comparison[mine == c], table, ways) for c in swaps]
        text += "".join(". " + s[0].upper() + s[1:] for s in said)
        out.append(
            {
                "factor": factor,
                "baseline": base,
                "alternative": alt,
                "verdict": top["verdict"],
                "text": text + ".",
            }
        )
    return out


def memory_findings(table: pd.DataFrame, ways: Ways = BY_VALUE) -> list[str]:
    """A sentence per pair of kernels of which one holds the (L, S) scores and the other does
    not (``Kernel.scores``: manual against sdpa, flex, ...): each one's peak memory at the
    shortest and the longest seq_len, from the attention pairs of effects.csv."""
    pairs = table[table["factor"] == "attention"]
    pairs = pairs[pairs["baseline_mem_mb"].notna() & pairs["alternative_mem_mb"].notna()]
    if "kv_cache_len" in pairs.columns:  # prefills: a decode step's scores are (1, P)
        pairs = pairs[pd.to_numeric(pairs["kv_cache_len"], errors="coerce").isna()]
    out = []
    for (base, alt), rows in pairs.groupby(["baseline", "alternative"], sort=False):
        facts = [ways.kernel(v) for v in (base, alt)]
        if None in facts or facts[0]["scores"] == facts[1]["scores"]:
            continue
        if rows["seq_len"].nunique() < 2:
            continue
        lengths = pd.to_numeric(rows["seq_len"])
        short, long_ = rows[lengths == lengths.min()], rows[lengths == lengths.max()]
        times = lengths.max() / lengths.min()
        sides = []
        for side, value, fact in zip(("baseline", "alternative"), (base, alt), facts):
            low, high = short[f"{side}_mem_mb"].median(), long_[f"{side}_mem_mb"].median()
            said = f"its (L, L) scores alone grow {times**2:.0f}x" if fact["scores"] else ""
            said = said or fact["memory"]
            sides.append(
                f"{ways.name('attention', str(value))} {low:.3g} -> {high:.3g} MiB "
                f"({high / low:.3g}x" + (f"; {said})" if said else ")")
            )
        out.append(
            f"peak memory from seq_len={lengths.min()} to {lengths.max()} ({times:.0f}x the "
            f"tokens; medians over the pairs): {sides[0]}, {sides[1]}."
        )
    return out


# Bytes a CPU's last-level cache can hold at most (the rows do not record its size): the CPU
# copy bandwidth's own buffer, 256 MiB, "larger than the last-level caches". A step moving more
# cannot have kept its bytes there between calls.
CPU_CACHE_BYTES = 256 * 2**20


def _above_copy(row) -> str:
    """Why a decode step can beat the copy bandwidth. A copy reads and writes every byte it counts
    and a decode step mostly reads, so above 100% is no sign of caching by itself. On CUDA the L2
    is flushed before every timed call (timing.flush_l2): nothing stays there. On a CPU, a step
    whose bytes fit in the last-level cache may have kept them there; one whose bytes do not
    cannot have."""
    step = number(row.get("bytes_per_call"))
    reason = ": a copy writes every byte it reads, a decode step mostly reads"
    if not str(row.get("device", "")).startswith("cuda") and step <= CPU_CACHE_BYTES:
        reason += f", and its {step / 2**20:.3g} MiB may have stayed in the CPU's caches"
    return reason


def decode_finding(rows: pd.DataFrame | None) -> str:
    """Decode steps are bound by memory bandwidth: the fastest way's GB/s at each cache length
    against the measured copy bandwidth, and what the cache buys over nn.MultiheadAttention,
    which recomputes the cached tokens' keys and values."""
    if rows is None or rows.empty or "gbps" not in rows.columns:
        return ""
    ok = timed_ok(rows)
    ok = ok[pd.to_numeric(ok["gbps"], errors="coerce").notna()]
    if ok.empty:
        return ""
    parts = []
    for length, group in ok.groupby(pd.to_numeric(ok["kv_cache_len"]), sort=True):
        best = group.loc[pd.to_numeric(group["gbps"]).idxmax()]
        text = f"P={int(length)}: {way(best)} {number(best['gbps']):.3g} GB/s"
        pct = number(best.get("pct_of_copy_bw"))
        if not math.isnan(pct):
            text += f" ({pct:.0f}% of copy{_above_copy(best) if pct > 100 else ''})"
        speed = number(best.get("speedup"))
        if not math.isnan(speed) and best.get("kv_cache") != "none":
            text += f", {_x(speed)} nn.MultiheadAttention's speed"
        parts.append(text)
    copy = pd.to_numeric(ok.get("copy_gbps"), errors="coerce").dropna()
    bw = f"; copy bandwidth measured at {copy.iloc[0]:.3g} GB/s" if len(copy) else ""
    return (
        "decoding against a KV cache, the fastest way per cache length: "
        + "; ".join(parts)
        + bw
        + " (nn.MultiheadAttention recomputes the cached tokens' keys and values every step)."
    )


def fastest_finding(ranked: pd.DataFrame) -> str:
    """The ranking in a sentence: which way was fastest where, and how sure that is. Shapes
    where a way was timed on a busy machine (``busy``) are not ranked, and said so."""
    if ranked.empty or (pd.to_numeric(ranked["n_ways"], errors="coerce") < 2).all():
        return ""  # one way per shape: nothing was compared
    busy = (
        pd.to_numeric(ranked["busy"], errors="coerce").fillna(0) > 0
        if "busy" in ranked.columns
        else pd.Series(False, index=ranked.index)
    )
    skipped = int(busy.sum())
    not_ranked = (
        f"{skipped} shape{'s' if skipped != 1 else ''} not ranked: the machine was busy"
        if skipped
        else ""
    )
    ranked = ranked[~busy]
    if ranked.empty or (pd.to_numeric(ranked["n_ways"], errors="coerce") < 2).all():
        return not_ranked + "." if not_ranked else ""
    n = len(ranked)
    counts = ranked["best"].value_counts()
    top, k = counts.index[0], int(counts.iloc[0])
    winners = int((ranked["winner"].fillna("") != "").sum())
    shapes = "ranked shapes" if skipped else "shapes"  # of those the machine was quiet for
    itself = False  # nn.MultiheadAttention (eager) is the best: 1x its own speed, said so
    if k == 1 and n > 1:  # no way is best at two shapes: naming the first would single it out
        mine, k = ranked, n
        text = (
            f"the fastest way differs by shape ({len(counts)} ways for {n} {shapes}; "
            "ranking.csv names each)"
        )
    else:
        mine = ranked[ranked["best"] == top]
        itself = str(top) == "reference"
        text = f"{way_name(top)} has the highest speedup at {k} of {n} {shapes}"
        text += " (no way measured there beat it)" if itself else ""
    speed = pd.to_numeric(mine["best_speedup"], errors="coerce").dropna()
    if len(speed) and not itself:
        low, high = speed.min(), speed.max()
        text += (
            f", {_x(low)} nn.MultiheadAttention's speed"
            if math.isclose(low, high, rel_tol=0.005)
            else f", {_x(low)}-{_x(high)} nn.MultiheadAttention's speed"
        )
        where = "here" if k == n else "at those shapes"
        if high < 1:  # the fastest is slower than nn.MHA: so is every way measured there
            text += f" (every way measured {where} is slower than nn.MultiheadAttention)"
        elif low < 1:
            text += (
                f" (below 1 at {int((speed < 1).sum())} of them: every way measured there is "
                "slower than nn.MultiheadAttention)"
            )
    tied = ranked.loc[ranked["winner"].fillna("") == "", "contenders"]
    sizes = sorted(len([c for c in str(v).split(";") if c]) for v in tied)
    if winners == n:
        text += f"; every {shapes[:-1]} has a clear winner (its interval clears every other way's)"
    elif winners:
        text += (
            f"; a clear winner at {winners} of {n} {shapes}, ties at the others "
            f"(a median of {sizes[len(sizes) // 2]} ways within the best's interval)"
        )
    else:
        text += (
            f"; no {shapes[:-1]} has a clear winner: a median of "
            f"{sizes[len(sizes) // 2]} ways are within the best's interval"
        )
    if "winner_factors" in ranked.columns:
        family = ranked[(ranked["winner"].fillna("") == "") & ranked["winner_factors"].notna()]
        family = family[family["winner_factors"].astype(str) != ""]
        said = [
            f"{r['winner_factors']} at {r['shape']} (its {r['tied_factors']} tie)"
            for r in family.to_dict("records")
        ]
        if said:
            text += (
                f"; at {len(said)} of those ties the tied ways are one family, faster than every "
                "other way: " + "; ".join(said)
            )
    if not_ranked:
        text += f"; {not_ranked}"
    return text + "."
