"""The result record's part of the timing in rounds (docs/methodology.md, "How a point is timed"):
the latency and its interval, the contention the rounds saw (harness/measure/contention.py) and
what the process compiled and kept meanwhile. Each field a column of results.csv, declared with
its unit and meaning (``col``)."""

from __future__ import annotations

from dataclasses import dataclass

from harness.column import Interval, Part, col, interval

# eager_ms_median over the device time (latency_ms_median, timed_by=graph) at or above which a
# CUDA point is launch-bound: a Python caller waits at least 1.25x what the GPU needs, i.e. the
# GPU idles a fifth of an eager call or more, waiting for Python's launches (docs/methodology.md,
# "How a point is timed").
LAUNCH_BOUND = 1.25


def launch_bound(row: dict) -> bool | None:
    """The row's ``launch_bound``: by measurement, the eager call time against the device time
    taken like it, with the L2 as the previous call left it (issue 56: against the flushed replay
    an L2-resident decode paced by Python read as GPU-bound); None where either is missing (the
    CPU, a call not captured in a CUDA graph)."""
    if row.get("timed_by") != "graph":
        return None
    eager = row.get("eager_ms_median")
    # like for like: the replay without the L2 flush where the device time had one
    device = row.get("replay_warm_ms_median")
    if device in (None, "") or device != device:
        device = row.get("latency_ms_median")
    if eager in (None, "") or device in (None, ""):
        return None
    return float(eager) >= LAUNCH_BOUND * float(device)


@dataclass(frozen=True)
class Timing(Part):
    """The rounds' figures (intervals are 95%), and what the process compiled and kept while
    they ran."""

    timing_state: str | None = col(
        "name",
        "`done`: timed in all its rounds; `partial`: the sweep was stopped after 2 or more of"
        " them (the columns below come from those); `pending`: checked, not yet timed (the "
        "sweep was stopped first); empty: not timed (`check_only`, or the point failed). "
        "`resume=true` finishes `pending` and `partial` rows",
        table=True,
        rounds=True,
    )
    latency: Interval | None = interval(
        "ms",
        "latency_ms_median",
        "latency of one call (forward, or forward + backward in `fwd_bwd`): the 20%-trimmed "
        "geometric mean over the rounds of each round's median call (2 of 11 rounds left out "
        "at each end; docs/methodology.md); on CUDA the device time (see "
        "`timed_by`); empty with `check_only`",
        "95% interval of the latency, from the spread between rounds spread over the sweep "
        "(drift included)",
        table=True,
        rounds=True,
    )
    speedup: Interval | None = interval(
        "ratio",
        "speedup",
        "nn.MultiheadAttention's time / this way's at the same shape, paired round by round "
        "(trimmed geometric mean, as the latency); exactly 1 on nn.MHA's own rows; above 1 is "
        "faster; empty where the two were timed differently (`timed_by`: a device time is not an "
        "eager call time; `eager_speedup` pairs their eager calls)",
        "95% interval of the speedup (drift that both saw cancels)",
        table=True,
        rounds=True,
    )
    timed_by: str | None = col(
        "name",
        "what `latency_ms_*` and `speedup*` time: `graph` (CUDA: the call captured once in a CUDA "
        "graph and replayed, device time without launch gaps), `events` (CUDA: CUDA events around "
        "the eager call, queued back to back: `graph_error` says why not a graph), `cpu` (CPU, one "
        "thread: the timed thread's CPU time per call, which holds no wait for a CPU a busy "
        "machine imposed; the wall time is `wall_ms_median`), `wall` (CPU, several threads, "
        "whose CPU time is their work, not a latency). "
        "A way timed otherwise than most of its shape is left out of its ranking, effects and "
        "findings, and the findings say so",
        table=True,
        rounds=True,
    )
    wall_ms_median: float | None = col(
        "ms",
        "`timed_by=cpu`: the wall time per call over the same rounds (trimmed geometric mean), "
        "beside the CPU time in `latency_ms_median`: on a quiet machine the two agree; the "
        "difference is what the scheduler gave other processes (docs/methodology.md, How a "
        "point is timed)",
        table=True,
        rounds=True,
    )
    graph_error: str | None = col(
        "text",
        "CUDA: why the call was not captured in a CUDA graph (`timed_by=events`); empty otherwise",
        rounds=True,
    )
    eager: Interval | None = interval(
        "ms",
        "eager_ms_median",
        "CUDA with `timed_by=graph`: the eager call time, what a Python caller calling it in a "
        "loop waits per call (CUDA events around each eager call, launches included, calls back "
        "to back with no L2 flush between), timed in the same repetitions as the replay; "
        "trimmed geometric mean over the rounds",
        "95% interval of `eager_ms_median`",
        table=True,
        table_bounds=False,
        rounds=True,
    )
    replay_warm_ms_median: float | None = col(
        "ms",
        "CUDA with `timed_by=graph` and `timing.flush_l2`: the graph's replay without the L2 "
        "flush, the L2 as the previous call left it, as the eager call runs (timed beside it in "
        "every repetition): what `launch_bound` compares the eager time with",
        rounds=True,
    )
    eager_speedup: Interval | None = interval(
        "ratio",
        "eager_speedup",
        "nn.MultiheadAttention's eager time / this way's eager time, paired round by round",
        "95% interval of `eager_speedup`",
        rounds=True,
    )
    latency_ms_iqr: float | None = col(
        "ms", "interquartile range (p75 - p25) of the rounds' values", rounds=True
    )
    latency_ms_p10: float | None = col(
        "ms", "10th and 90th percentiles of the rounds' values", rounds=True
    )
    latency_ms_p90: float | None = col(
        "ms", "10th and 90th percentiles of the rounds' values", rounds=True
    )
    host_ms_per_call: float | None = col(
        "ms",
        "what a Python caller that waits for every call waits per call: the median of the warm-up "
        "calls, each synchronised (on CUDA the kernels' launch included; latency_ms_median is "
        "device time, calls queued back to back)",
        table=True,
        rounds=True,
    )
    launch_ms_per_call: float | None = col(
        "ms",
        "CUDA: host time to enqueue one call (its kernel launches, no wait): the least over the "
        "first calls of each repetition (before the launch queue fills), the median over the "
        "repetitions; empty on the CPU",
        rounds=True,
    )
    sm_clock_mhz_min: float | None = col(
        "MHz",
        "CUDA with NVML (nvidia-ml-py): the lowest SM clock read after the point's repetitions",
        rounds=True,
    )
    sm_clock_mhz_median: float | None = col(
        "MHz", "CUDA with NVML: the median SM clock over them", rounds=True
    )
    power_w_median: float | None = col(
        "W", "CUDA with NVML: the median board power over them", rounds=True
    )
    temp_c_max: float | None = col(
        "°C", "CUDA with NVML: the highest GPU temperature over them", rounds=True
    )
    throttled: bool | None = col(
        "bool",
        "CUDA with NVML: the GPU throttled (a thermal or hardware slowdown) during the point's "
        "repetitions: its times are not comparable with a published figure",
        table=True,
        rounds=True,
    )
    power_capped: bool | None = col(
        "bool",
        "CUDA with NVML: the GPU was at its power cap during some of the point's repetitions "
        "(SwPowerCap): the board's normal state under a heavy kernel, not throttling; its clocks "
        "are in `sm_clock_mhz_min` and `sm_clock_mhz_median`",
        rounds=True,
    )
    launch_bound: bool | None = col(
        "bool",
        "CUDA: `eager_ms_median` is at least 1.25x the device time taken the same way, the "
        "replay without the L2 flush (`replay_warm_ms_median`; `latency_ms_median` where the "
        "device time had no flush): a Python caller waits for its launches, the GPU idles "
        "between kernels (a CUDA graph, compile=reduce-overhead or a bigger batch would help); "
        "empty on the CPU and where the call was not captured (`graph_error`)",
        table=True,
        compute=launch_bound,
    )
    n_samples: int | None = col(
        "count",
        "rounds the intervals are built from (each the median of `calls_per_round` calls): the "
        "clean ones, or every round when the point stayed `contended`",
        table=True,
        rounds=True,
    )
    calls_per_round: int | None = col("count", "timed calls in each repetition", rounds=True)
    rounds_span_s: float | None = col(
        "s",
        "time from the point's first round to its last (how far its repetitions are spread)",
        rounds=True,
    )
    noise: float | None = col(
        "ratio",
        "relative half-width of the 95% interval the row is ranked by: speedup, or latency on"
        " nn.MHA's own rows (0.05 = ±5%)",
        table=True,
        rounds=True,
    )
    noise_target_met: bool | None = col(
        "bool", "`noise <= timing.max_noise`", table=True, rounds=True
    )
    rerun_noise: float | None = col(
        "ratio",
        "the between-run relative sd under the row's intervals (`timing.rerun_noise`, or the "
        "device kind's floor earned from re-runs, widened by the shape's rounds: "
        "`rerun_noise_from`); effects.csv puts it under the effects' intervals too",
        rounds=True,
    )
    rerun_noise_from: str | None = col(
        "name",
        "where `rerun_noise` comes from: `config` (`timing.rerun_noise` set), `earned` (the "
        "device kind's floor measured from re-runs by make stability or make gpu-check "
        "STEP=stability, harness/floors.json, with its date and machine), `rounds` (the drift "
        "between the first and second halves of the shape's rounds was larger and widened it: "
        "docs/methodology.md), `assumed` (no floor earned for the device kind: cpu 0.04, cuda "
        "0.02)",
        rounds=True,
    )
    timing_s: float | None = col(
        "s", "time spent timing this point: warm-up plus its repetitions", rounds=True
    )
    recompiles: int | None = col(
        "count", "graphs compiled during timing and probing (should be 0)", rounds=True
    )
    mem_growth_mb: float | None = col(
        "MiB",
        "memory the process gained over the point's timed repetitions, from the allocator's "
        "counter (CUDA: allocated tensors; CPU: bytes malloc has handed out, glibc's "
        "mallinfo2; the resident set where there is no such counter); about 0 for a correct "
        "variant",
        table=True,
        rounds=True,
    )
    leak: bool | None = col(
        "bool",
        "memory grew by at least 1 MiB, in at least 3 of 4 repetitions, and grew again (by "
        "half as much at least) over as many calls made once more after the rounds: the "
        "variant keeps something from every call. Empty when the rounds were stopped before "
        "that second measurement",
        table=True,
        rounds=True,
    )


@dataclass(frozen=True)
class Contention(Part):
    """What the machine did while the rounds ran (harness/measure/contention.py)."""

    contended: bool | None = col(
        "bool",
        "contention spoiled this point's rounds (or those of the nn.MultiheadAttention it pairs "
        "with) and, after re-timing, it kept fewer clean pairs than two thirds of "
        "`timing.rounds`: its intervals are what was measured (its own clean rounds where it has "
        "enough), and no winner, effect or A/B verdict is decided from it",
        table=True,
        rounds=True,
    )
    contended_rounds: int | None = col(
        "count",
        "repetitions spoiled by contention (re-timed in a later round, `timing.retime_rounds`, "
        "and left out of the intervals while the point has enough clean ones)",
        rounds=True,
    )
    cpu_wait: float | None = col(
        "ratio",
        "median over the repetitions of the time the process's threads waited for a CPU "
        "(schedstat's run delay) over the repetition's wall time; above 0.05 a repetition is "
        "spoiled; empty where the kernel keeps no schedstat",
        rounds=True,
    )
    busy_cores: float | None = col(
        "cores",
        "median over the repetitions of the cores other processes kept busy (/proc/stat's busy "
        "time less this process's CPU time, over wall time; about +-0.2 core)",
        rounds=True,
    )
    cores: int | None = col("count", "CPU cores this process may run on", rounds=True)
    steal_cores: float | None = col(
        "cores",
        "median cores the hypervisor took during the repetitions (/proc/stat's steal)",
        rounds=True,
    )
    cpu_share: float | None = col(
        "cores",
        "median of the process's CPU time (user + system, every thread) over wall time",
        rounds=True,
    )
    switches_per_s: float | None = col(
        "1/s",
        "median involuntary context switches of the process per second of a repetition",
        rounds=True,
    )
    load_avg: int | None = col(
        "count", "the highest 1-minute load average read after a repetition", rounds=True
    )
    gpu_others: int | None = col(
        "count",
        "CUDA: the most other processes holding a context on the GPU during a repetition (NVML)",
        rounds=True,
    )
    contention: str | None = col(
        "text",
        "what the spoiled repetitions saw, in words (empty when none was spoiled)",
        rounds=True,
    )
