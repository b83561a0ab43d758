"""The result row, defined once: every column of results.csv, its unit and its meaning.

``results.COLUMNS`` (the CSV's order), the report's table (``table=True``), the columns the timing
rounds fill in (``rounds=True``) and docs/reference.md's column table are all read from
``ROW`` below (the check's columns: harness/schema_check.py; the timing's and contention's:
harness/schema_timing.py). Adding a column is one
``Column(...)`` line here, plus the code that fills it; or a ``compute=`` function of the row,
which ``results.write_row`` applies to every row.
"""

from __future__ import annotations

from dataclasses import fields

from harness.column import Column
from harness.config import IDENTITY_KEYS, Point
from harness.schema_check import CHECK
from harness.schema_effects import EFFECT, SUMMARY  # noqa: F401 (imported from here)
from harness.schema_timing import LAUNCH_BOUND, TIMING, launch_bound  # noqa: F401 (re-exported)


def pin_kept(pin, kernel) -> bool | None:
    """Whether the SDPA kernel that ran is the one ``sdpa_backend`` pinned (None: no pin, or no
    SDPA kernel ran)."""
    ran = {k for k in str(kernel or "").split("+") if k in ("flash", "efficient", "cudnn", "math")}
    if pin in (None, "", "auto") or not ran:
        return None
    return ran == {pin}


ROW = [
    # identity: what was asked, and what ran
    Column("variant", "name", "config group choice (`reference`, `fused`, ...)"),
    Column("variant_options", "text", "the variant's options, `attention=sdpa merge=view`"),
    Column(
        "label",
        "text",
        "variant plus option values, `fused/attention=sdpa,merge=view`; plots and tables "
        "group by it",
    ),
    Column("variant_target", "dotted path", "the class that ran (the yaml's `_target_`)"),
    Column(
        "variant_source_hash",
        "hex",
        "sha1 of the file the class is defined in, first 12 digits: two rows with the same "
        "hash ran the same code",
    ),
    Column(
        "variant_distribution",
        "text",
        "the installed distribution the class's package comes from, name and version "
        "(`mha-bench 0.1.0`, `timm 1.0.9`); empty for a module on PYTHONPATH",
    ),
    Column(
        "fixed",
        "text",
        "what the variant's `_fixed_` declaration put in place of the asked values, "
        "`bias=false (asked true)`; empty when the point ran as asked (the other columns "
        "always say what ran)",
        table=True,
    ),
    Column("compile", "off/mode", "torch.compile mode"),
    Column("mode", "name", "fwd, fwd_bwd", table=True),
    Column("batch", "count", "B", table=True),
    Column("seq_len", "tokens", "L, query length", table=True),
    Column("kv_seq_len", "tokens", "S, key/value length", table=True),
    Column("embed_dim", "features", "E", table=True),
    Column("num_heads", "count", "H", table=True),
    Column(
        "num_kv_heads",
        "count",
        "K/V heads (grouped-query attention when below H); nn.MultiheadAttention computes H of "
        "them, each K/V head repeated for its group",
        table=True,
    ),
    Column(
        "kv_cache_len",
        "tokens",
        "P, keys and values cached before a decode step (empty: no cache)",
        table=True,
    ),
    Column(
        "kv_cache",
        "name",
        "decode: how the cache was held, `static` (written in place), `concat` (copied per "
        "step), `none` (no cache: the prefix's keys and values recomputed, nn.MHA); empty "
        "without kv_cache_len",
        table=True,
    ),
    Column("window", "tokens", "W, keys each query sees with mask=sliding"),
    Column("head_dim", "features", "D = E / H"),
    Column("dtype", "name", "float32, float16, bfloat16", table=True),
    Column("device", "name", "cpu, cuda, cuda:N (resolved, never `auto`)", table=True),
    Column("mask", "name", "none, causal, padding, sliding", table=True),
    Column("mask_format", "name", "bool, additive"),
    Column("need_weights", "bool", "attention weights returned, checked and timed"),
    Column("average_attn_weights", "bool", "weights averaged over heads (else per head)"),
    Column("cross", "bool", "key/value separate from query"),
    Column(
        "bias",
        "bool or layout",
        "projections with bias: true, false, `qkv` (query, key and value only) or `out` "
        "(output only)",
    ),
    Column("seed", "int", "seed of weights and inputs"),
    Column("sdpa_backend", "name", "the SDPA pin asked for (`auto`: none)"),
    Column("num_threads", "count", "torch CPU threads used"),
    # outcome
    Column(
        "status",
        "name",
        "`ok`, `mismatch` (check failed, or not a drop-in), `oom`, `unsupported`, `invalid` "
        "(bad value), `error`, `crashed` (the worker died), `timeout` (over `point_timeout`);"
        ' see "When something goes wrong"',
        table=True,
    ),
    Column("error", "text", "why, when status is not `ok` (empty otherwise)", table=True),
    Column(
        "torch_changed",
        "names",
        "what of torch the variant changed on import or in its calls "
        "(`torch.nn.MultiheadAttention.forward`): not timed, `unsupported` where its check "
        "passed, and the worker replaced before the next point (harness/fingerprint.py); empty: "
        "nothing",
    ),
    Column(
        "timing_state",
        "name",
        "`done`: timed in all its rounds; `partial`: the sweep was stopped after 2 or more of"
        " them (the columns below come from those); `pending`: checked, not yet timed (the "
        "sweep was stopped first); empty: not timed (`check_only`, or the point failed). "
        "`resume=true` finishes `pending` and `partial` rows",
        table=True,
        rounds=True,
    ),
    *TIMING,
    # throughput and roofline
    Column("flops", "FLOP", "FLOP model of one call (docs/methodology.md)"),
    Column("tflops", "TFLOP/s", "`flops / latency_ms_median`", table=True, rounds=True),
    Column(
        "peak_tflops", "TFLOP/s", "measured dense-matmul peak, this device and dtype", rounds=True
    ),
    Column("pct_of_peak", "%", "`100 * tflops / peak_tflops`", table=True, rounds=True),
    Column(
        "peak_tflops_datasheet",
        "TFLOP/s",
        "the GPU's datasheet peak (empty if unknown, and on CPUs)",
        rounds=True,
    ),
    Column(
        "pct_of_datasheet_peak",
        "%",
        "`100 * tflops / peak_tflops_datasheet`",
        table=True,
        rounds=True,
    ),
    Column(
        "bytes_per_call",
        "B",
        "decode: the bytes a step must move at least (weights, the cache's keys and values, the "
        "new ones written, input and output; the same for every way at the point); empty "
        "without kv_cache_len",
    ),
    Column(
        "gbps", "GB/s", "`bytes_per_call / latency_ms_median` (decode)", table=True, rounds=True
    ),
    Column(
        "copy_gbps",
        "GB/s",
        "measured copy bandwidth of this device (reads + writes of a large `copy_`; decode)",
        rounds=True,
    ),
    Column("pct_of_copy_bw", "%", "`100 * gbps / copy_gbps` (decode)", table=True, rounds=True),
    # what ran, memory, compile
    Column(
        "sdpa_kernel",
        "name",
        "SDPA backend that ran: flash, efficient, cudnn, math, cpu_flash; `flex` for "
        "attention=flex; none",
        table=True,
    ),
    Column(
        "sdpa_pin_kept",
        "bool",
        "`sdpa_backend` pinned and an SDPA kernel ran: whether it is the pinned one (a compiled "
        "graph cached under another pin can ignore it: PyTorch issue 185449); empty otherwise",
        table=True,
        compute=lambda row: pin_kept(row.get("sdpa_backend"), row.get("sdpa_kernel")),
    ),
    Column(
        "mem_estimate_mb",
        "MiB",
        "lower bound of what the point holds on its device during the check (inputs, weights,"
        " activations, the L x S scores where the path materialises them, x3 in `fwd_bwd`), "
        "checked against free memory before anything is built",
    ),
    Column(
        "peak_mem_mb",
        "MiB",
        "peak memory the call allocated beyond its inputs (docs/methodology.md)",
        table=True,
    ),
    Column(
        "scores_materialized", "bool", "the full B·H·L·S score matrix existed in memory", table=True
    ),
    Column(
        "compile_s",
        "s",
        "first call of the compiled variant, compilation included (empty when nothing was "
        "compiled)",
        table=True,
    ),
    Column("compiled_graphs", "count", "graphs compiled for the point"),
    Column(
        "cuda_graphs",
        "bool",
        "compile=reduce-overhead or max-autotune: whether the timed call replays CUDA graphs; "
        "false on the CPU and where inductor skipped them (it does so for an input mutated in "
        "place, such as a KV cache written at decode, saying so only in a log line); empty for "
        "other compile modes",
    ),
    Column(
        "compiled_shapes",
        "name",
        "`compile` on: `static` when the graph timed was compiled for the point's own shapes "
        "(always, unless a variant asks otherwise), `dynamic` when it takes symbolic sizes; read "
        "from Dynamo's guards, empty where this torch does not say",
        table=True,
    ),
    Column(
        "recompiles",
        "count",
        "graphs compiled during timing and probing (should be 0)",
        rounds=True,
    ),
    Column(
        "mem_growth_mb",
        "MiB",
        "memory the process gained over the point's timed repetitions, from the allocator's "
        "counter (CUDA: allocated tensors; CPU: bytes malloc has handed out, glibc's "
        "mallinfo2; the resident set where there is no such counter); about 0 for a correct "
        "variant",
        table=True,
        rounds=True,
    ),
    Column(
        "leak",
        "bool",
        "memory grew by at least 1 MiB, in at least 3 of 4 repetitions, and grew again (by "
        "half as much at least) over as many calls made once more after the rounds: the "
        "variant keeps something from every call. Empty when the rounds were stopped before "
        "that second measurement",
        table=True,
        rounds=True,
    ),
    # profiling pass (profile=true)
    Column(
        "trace_dir", "path", "`profile=true`: the point's trace dir, relative to the run/sweep dir"
    ),
    Column("ops_per_call", "count", "aten ops per call in the profiling pass"),
    Column("copies_per_call", "count", "`aten::copy_` per call"),
    Column("kernels_per_call", "count", "CUDA kernels per call (empty on CPU)"),
    Column("top_ops", "text", "the five operators with the most self time, with calls per call"),
    Column("profile_error", "text", "why the profiling pass failed (the row keeps its timing)"),
    *CHECK,
    # environment (env.json at the run or sweep root has the rest)
    Column("device_name", "text", "GPU name, or the CPU model"),
    Column(
        "gpus_hidden",
        "count",
        "GPUs the NVIDIA driver has that torch did not see (CUDA_VISIBLE_DEVICES empty, as "
        "submitit's local launcher sets it when asked for no GPU; a CPU-only torch): above 0 on a "
        "`cpu` row, `device=auto` fell back to the CPU on a GPU machine (the log warns)",
    ),
    Column("torch_version", "text", "`torch.__version__`"),
    Column("cuda_version", "text", "CUDA torch was built with (empty on CPU builds)"),
    Column("git_commit", "text", "commit of this checkout, `-dirty` when modified"),
    Column("hostname", "text", "machine name"),
    # provenance
    Column("overrides", "text", "the point's Hydra overrides"),
    Column(
        "config_hash",
        "text",
        "fingerprint of the point's full configuration (all keys but `resume`, `report_dir`, "
        "`point_timeout`); `resume=true` matches on it",
    ),
]
# A config key that is part of a row's identity (its shape, way or machine: harness/config.py's
# roles) and has no column above gets one, its meaning the key's help: a new key is one field.
ROW += [
    Column(f.name, "config key", f.metadata["help"])
    for f in fields(Point)
    if f.name in IDENTITY_KEYS and f.name not in {c.name for c in ROW} | {"variant"}
]


def computed(row: dict) -> dict:
    """``row`` with the columns the schema computes from the others (``Column.compute``) filled
    in where empty; a row that got less far than a computation needs gets None there."""
    row = dict(row)
    for column in ROW:
        if column.compute is not None and row.get(column.name) in (None, ""):
            try:
                row[column.name] = column.compute(row)
            except (KeyError, TypeError, ValueError, ZeroDivisionError):
                row[column.name] = None
    return row
