"""The columns of effects.csv and effects_summary.csv (harness/report/effects.py), defined once."""

from __future__ import annotations

from harness.column import Column

# effects.csv (harness/report/effects.py): one row per pair of ways that differ in exactly one
# factor, at one shape. Its shape columns (results.SHAPE_KEYS) follow `factor`...`context`.
EFFECT = [
    Column(
        "factor",
        "name",
        "what differs: `structure` (the variant), a variant option"
        " (`attention`, `merge`, ...), `compile`, `sdpa_backend`, `kv_cache` (decode); or, for"
        " the same way, the model's `num_kv_heads` or `mask` (causal against `sliding:W`)",
    ),
    Column(
        "baseline",
        "name",
        "the factor's value the ratio is relative to (`separate`,"
        " `manual`, `view`, `off`, `auto`: the first in effects.BASELINE_FIRST)",
    ),
    Column("alternative", "name", "the other value (`fused`, `sdpa`, `reshape`, `default`, ...)"),
    Column(
        "context",
        "text",
        "the other factors, held fixed (`structure=fused attention=sdpa"
        " merge=view compile=off sdpa_backend=auto`)",
    ),
    Column(
        "shape",
        "text",
        "the shape, as the report writes it (`B=2 L=128 E=256 H=4 float32 cpu mask=none`)",
    ),
    Column(
        "ratio",
        "x",
        "baseline time / alternative time: above 1 the alternative is faster"
        " (geometric mean over the paired rounds)",
    ),
    Column(
        "ratio_ci_low",
        "x",
        "95% interval of `ratio` (between the rounds, plus the rows' `rerun_noise`)",
    ),
    Column("ratio_ci_high", "x", "upper bound of that interval"),
    Column(
        "verdict",
        "name",
        "`faster` (interval above 1), `slower` (below 1) or `tie`"
        " (contains 1): said of the alternative; `busy` where either row stayed `contended`"
        " (timed on a busy machine: its ratio is what was measured and decides nothing; left"
        " out of every summary)",
    ),
    Column("n_pairs", "count", "rounds in which both ways were timed (same run, same round)"),
    Column(
        "basis",
        "name",
        "`rounds`: paired round by round from the rounds' journal;"
        " `speedups`: the two rows' speedups over nn.MHA divided (no journal: wider);"
        " empty for a `busy` pair with neither. Repetitions the journal marks contended"
        " (re-timed) are never paired",
    ),
    Column("baseline_way", "name", "the baseline's way, as in the report"),
    Column("alternative_way", "name", "the alternative's way"),
    Column("baseline_ms", "ms", "the baseline's `latency_ms_median`"),
    Column("alternative_ms", "ms", "the alternative's `latency_ms_median`"),
    Column("baseline_mem_mb", "MiB", "the baseline's `peak_mem_mb`"),
    Column("alternative_mem_mb", "MiB", "the alternative's `peak_mem_mb`"),
    Column(
        "rerun_noise",
        "ratio",
        "the between-run floor under the interval (the rows' `rerun_noise`, the larger of the two)",
    ),
    Column(
        "baseline_kernel", "name", "the baseline's `sdpa_kernel`: the attention kernel that ran"
    ),
    Column("alternative_kernel", "name", "the alternative's `sdpa_kernel`"),
    Column(
        "kernel_change",
        "text",
        "`baseline_kernel->alternative_kernel` (`none->cudnn`: Inductor turned compiled manual"
        " attention into cuDNN SDPA) where the pair ran different kernels and the factor is not"
        " the kernel's own choice (`attention`, `sdpa_backend`); empty when the same kernel ran"
        " or a kernel is unknown. The summary keeps such pairs apart",
    ),
    Column(
        "baseline_eager_ms",
        "ms",
        "CUDA: the baseline's `eager_ms_median` (the eager call a Python caller waits); empty on"
        " the CPU",
    ),
    Column("alternative_eager_ms", "ms", "CUDA: the alternative's `eager_ms_median`"),
    Column(
        "eager_ratio",
        "x",
        "CUDA: the same ratio of the eager call times (baseline / alternative): the two rows'"
        " `eager_speedup` divided, their intervals combined; empty on the CPU",
    ),
    Column("eager_ratio_ci_low", "x", "95% interval of `eager_ratio`"),
    Column("eager_ratio_ci_high", "x", "upper bound of that interval"),
]

# effects_summary.csv: each comparison (factor, baseline, alternative) over the sweep's shapes,
# overall (`by` = all) and split by each shape key or other factor that varies.
SUMMARY = [
    Column("factor", "name", "as in effects.csv"),
    Column("baseline", "name", "as in effects.csv"),
    Column("alternative", "name", "as in effects.csv"),
    Column(
        "kernel_change",
        "text",
        "as in effects.csv: pairs whose kernel changed (`none->cudnn`) are summed up apart from"
        " those that ran the same kernel (empty), so that a kernel swap is not read as the"
        " factor's effect",
    ),
    Column(
        "by",
        "name",
        "`all`, or the key the pairs are split by (`seq_len`, `dtype`,"
        " `mask`, `structure`, `compile`, ...)",
    ),
    Column("value", "text", "that key's value (empty for `all`)"),
    Column(
        "n",
        "count",
        "pairs (shapes x settings of the other factors) the statistics are over: `busy` pairs"
        " are not among them",
    ),
    Column("ratio", "x", "geometric mean of the pairs' ratios"),
    Column(
        "ratio_ci_low",
        "x",
        "95% interval of that mean: Student's t over the pairs' log"
        " ratios (their spread, which includes how the effect varies), plus `rerun_noise`;"
        " one pair: its own interval",
    ),
    Column("ratio_ci_high", "x", "upper bound of that interval"),
    Column("ratio_min", "x", "the smallest pair ratio"),
    Column("ratio_max", "x", "the largest pair ratio"),
    Column("faster", "count", "pairs whose verdict is `faster`"),
    Column("ties", "count", "pairs whose verdict is `tie`"),
    Column("slower", "count", "pairs whose verdict is `slower`"),
    Column(
        "verdict",
        "name",
        "of the mean: `faster`, `slower` or `tie`; `busy` when every pair is busy (nothing was"
        " measured: `n` is 0)",
    ),
    Column(
        "eager_ratio",
        "x",
        "CUDA: the geometric mean of the pairs' `eager_ratio` (eager call times; `ratio` is of"
        " device times there), with its interval as `ratio`'s; empty on the CPU",
    ),
    Column("eager_ratio_ci_low", "x", "95% interval of `eager_ratio`"),
    Column("eager_ratio_ci_high", "x", "upper bound of that interval"),
    Column("eager_verdict", "name", "`faster`, `slower` or `tie`, of `eager_ratio`"),
    Column(
        "busy",
        "count",
        "pairs left out because a row of theirs stayed `contended` (timed on a busy machine:"
        " verdict `busy` in effects.csv)",
    ),
]
