"""The result row's columns of the timing in rounds (docs/methodology.md, "How a point is timed")
and of the contention the rounds saw (harness/measure/contention.py), in the CSV's order: part of
harness/schema.py's ``ROW``."""

from __future__ import annotations

from harness.column import Column

# eager_ms_median over the device time (latency_ms_median, timed_by=graph) at or above which a
# CUDA point is launch-bound: a Python caller waits at least 1.25x what the GPU needs, i.e. the
# GPU idles a fifth of an eager call or more, waiting for Python's launches (docs/methodology.md,
# "How a point is timed").
LAUNCH_BOUND = 1.25


def launch_bound(row: dict) -> bool | None:
    """The row's ``launch_bound``: by measurement, the eager call time against the device time;
    None where either is missing (the CPU, a call not captured in a CUDA graph)."""
    if row.get("timed_by") != "graph":
        return None
    eager, device = row.get("eager_ms_median"), row.get("latency_ms_median")
    if eager in (None, "") or device in (None, ""):
        return None
    return float(eager) >= LAUNCH_BOUND * float(device)


TIMING = [
    # timing in rounds (docs/methodology.md): intervals are 95%
    Column(
        "latency_ms_median",
        "ms",
        "latency of one call (forward, or forward + backward in `fwd_bwd`): the 20%-trimmed "
        "geometric mean over the rounds of each round's median call (2 of 11 rounds left out "
        "at each end; docs/methodology.md); on CUDA the device time (see "
        "`timed_by`); empty with `check_only`",
        table=True,
        rounds=True,
    ),
    Column(
        "latency_ms_ci_low",
        "ms",
        "95% interval of the latency, from the spread between rounds spread over the sweep "
        "(drift included)",
        table=True,
        rounds=True,
    ),
    Column(
        "latency_ms_ci_high",
        "ms",
        "95% interval of the latency, from the spread between rounds spread over the sweep "
        "(drift included)",
        table=True,
        rounds=True,
    ),
    Column(
        "speedup",
        "ratio",
        "nn.MultiheadAttention's time / this way's at the same shape, paired round by round "
        "(trimmed geometric mean, as the latency); exactly 1 on nn.MHA's own rows; above 1 is "
        "faster",
        table=True,
        rounds=True,
    ),
    Column(
        "speedup_ci_low",
        "ratio",
        "95% interval of the speedup (drift that both saw cancels)",
        table=True,
        rounds=True,
    ),
    Column(
        "speedup_ci_high",
        "ratio",
        "95% interval of the speedup (drift that both saw cancels)",
        table=True,
        rounds=True,
    ),
    Column(
        "timed_by",
        "name",
        "what `latency_ms_*` and `speedup*` time: `graph` (CUDA: the call captured once in a CUDA "
        "graph and replayed, device time without launch gaps), `events` (CUDA: CUDA events around "
        "the eager call, queued back to back: `graph_error` says why not a graph), `wall` (CPU)",
        table=True,
        rounds=True,
    ),
    Column(
        "graph_error",
        "text",
        "CUDA: why the call was not captured in a CUDA graph (`timed_by=events`); empty otherwise",
        rounds=True,
    ),
    Column(
        "eager_ms_median",
        "ms",
        "CUDA with `timed_by=graph`: the eager call time, what a Python caller calling it in a "
        "loop waits per call (CUDA events around each eager call, launches included, calls back "
        "to back with no L2 flush between), timed in the same repetitions as the replay; "
        "trimmed geometric mean over the rounds",
        table=True,
        rounds=True,
    ),
    Column("eager_ms_ci_low", "ms", "95% interval of `eager_ms_median`", rounds=True),
    Column("eager_ms_ci_high", "ms", "95% interval of `eager_ms_median`", rounds=True),
    Column(
        "eager_speedup",
        "ratio",
        "nn.MultiheadAttention's eager time / this way's eager time, paired round by round",
        rounds=True,
    ),
    Column("eager_speedup_ci_low", "ratio", "95% interval of `eager_speedup`", rounds=True),
    Column("eager_speedup_ci_high", "ratio", "95% interval of `eager_speedup`", rounds=True),
    Column(
        "latency_ms_iqr", "ms", "interquartile range (p75 - p25) of the rounds' values", rounds=True
    ),
    Column("latency_ms_p10", "ms", "10th and 90th percentiles of the rounds' values", rounds=True),
    Column("latency_ms_p90", "ms", "10th and 90th percentiles of the rounds' values", rounds=True),
    Column(
        "host_ms_per_call",
        "ms",
        "what a Python caller that waits for every call waits per call: the median of the warm-up "
        "calls, each synchronised (on CUDA the kernels' launch included; latency_ms_median is "
        "device time, calls queued back to back)",
        table=True,
        rounds=True,
    ),
    Column(
        "launch_ms_per_call",
        "ms",
        "CUDA: host time to enqueue one call (its kernel launches, no wait): the least over the "
        "first calls of each repetition (before the launch queue fills), the median over the "
        "repetitions; empty on the CPU",
        rounds=True,
    ),
    Column(
        "sm_clock_mhz_min",
        "MHz",
        "CUDA with NVML (nvidia-ml-py): the lowest SM clock read after the point's repetitions",
        rounds=True,
    ),
    Column(
        "sm_clock_mhz_median", "MHz", "CUDA with NVML: the median SM clock over them", rounds=True
    ),
    Column("power_w_median", "W", "CUDA with NVML: the median board power over them", rounds=True),
    Column(
        "temp_c_max", "°C", "CUDA with NVML: the highest GPU temperature over them", rounds=True
    ),
    Column(
        "throttled",
        "bool",
        "CUDA with NVML: the GPU throttled (power cap, thermal or hardware "
        "slowdown) during the point's repetitions: its times are not comparable with a "
        "published figure",
        table=True,
        rounds=True,
    ),
    Column(
        "launch_bound",
        "bool",
        "CUDA: `eager_ms_median` is at least 1.25x the device time `latency_ms_median`: a Python "
        "caller waits for its launches, the GPU idles between kernels (a CUDA graph, "
        "compile=reduce-overhead or a bigger batch would help); empty on the CPU and where the "
        "call was not captured (`graph_error`)",
        table=True,
        compute=launch_bound,
    ),
    Column(
        "n_samples",
        "count",
        "rounds the intervals are built from (each the median of `calls_per_round` calls): the "
        "clean ones, or every round when the point stayed `contended`",
        table=True,
        rounds=True,
    ),
    Column("calls_per_round", "count", "timed calls in each repetition", rounds=True),
    Column(
        "rounds_span_s",
        "s",
        "time from the point's first round to its last (how far its repetitions are spread)",
        rounds=True,
    ),
    Column(
        "noise",
        "ratio",
        "relative half-width of the 95% interval the row is ranked by: speedup, or latency on"
        " nn.MHA's own rows (0.05 = ±5%)",
        table=True,
        rounds=True,
    ),
    Column("noise_target_met", "bool", "`noise <= timing.max_noise`", table=True, rounds=True),
    Column(
        "rerun_noise",
        "ratio",
        "the between-run relative sd under the row's intervals (`timing.rerun_noise`, or the "
        "device kind's floor earned from re-runs, widened by the shape's rounds: "
        "`rerun_noise_from`); effects.csv puts it under the effects' intervals too",
        rounds=True,
    ),
    Column(
        "rerun_noise_from",
        "name",
        "where `rerun_noise` comes from: `config` (`timing.rerun_noise` set), `earned` (the "
        "device kind's floor measured from re-runs by make stability or make gpu-check "
        "STEP=stability, harness/floors.json, with its date and machine), `rounds` (the drift "
        "between the first and second halves of the shape's rounds was larger and widened it: "
        "docs/methodology.md), `assumed` (no floor earned for the device kind: cpu 0.04, cuda "
        "0.02)",
        rounds=True,
    ),
    Column(
        "timing_s", "s", "time spent timing this point: warm-up plus its repetitions", rounds=True
    ),
    # contention: what the machine did while the rounds ran (harness/measure/contention.py)
    Column(
        "contended",
        "bool",
        "contention spoiled this point's rounds and, after re-timing, it kept fewer clean ones "
        "than two thirds of `timing.rounds`: its intervals are what was measured, and no winner, "
        "effect or A/B verdict is decided from it",
        table=True,
        rounds=True,
    ),
    Column(
        "contended_rounds",
        "count",
        "repetitions spoiled by contention (re-timed in a later round, `timing.retime_rounds`, "
        "and left out of the intervals while the point has enough clean ones)",
        rounds=True,
    ),
    Column(
        "cpu_wait",
        "ratio",
        "median over the repetitions of the time the process's threads waited for a CPU "
        "(schedstat's run delay) over the repetition's wall time; above 0.05 a repetition is "
        "spoiled; empty where the kernel keeps no schedstat",
        rounds=True,
    ),
    Column(
        "busy_cores",
        "cores",
        "median over the repetitions of the cores other processes kept busy (/proc/stat's busy "
        "time less this process's CPU time, over wall time; about +-0.2 core)",
        rounds=True,
    ),
    Column("cores", "count", "CPU cores this process may run on", rounds=True),
    Column(
        "steal_cores",
        "cores",
        "median cores the hypervisor took during the repetitions (/proc/stat's steal)",
        rounds=True,
    ),
    Column(
        "cpu_share",
        "cores",
        "median of the process's CPU time (user + system, every thread) over wall time",
        rounds=True,
    ),
    Column(
        "switches_per_s",
        "1/s",
        "median involuntary context switches of the process per second of a repetition",
        rounds=True,
    ),
    Column(
        "load_avg",
        "count",
        "the highest 1-minute load average read after a repetition",
        rounds=True,
    ),
    Column(
        "gpu_others",
        "count",
        "CUDA: the most other processes holding a context on the GPU during a repetition (NVML)",
        rounds=True,
    ),
    Column(
        "contention",
        "text",
        "what the spoiled repetitions saw, in words (empty when none was spoiled)",
        rounds=True,
    ),
]
