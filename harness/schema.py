"""The result record, defined once: a point's typed parts, each field a column of results.csv
with its unit and meaning (``col``, harness/column.py), and the order they take in the CSV.

Each stage of a point returns its part (docs/architecture.md, "A point's record"): ``Identity``
when it is admitted, ``Check`` and ``Diagnosis`` from the check (harness/schema_check.py),
``Probe`` and ``Profile`` after the warm-up, ``Timing`` and ``Contention`` from the rounds
(harness/schema_timing.py), ``Throughput`` from the timing, ``Environment`` from the machine,
``Provenance`` where the row is written, and the ``Outcome`` (harness/outcome.py) decided by one
rule as the stages report. ``Record.columns`` flattens them once, where the CSV is written
(harness/sweep/run.py). ``ROW`` (every column in the CSV's order), the report's table
(``table=True``), the columns the rounds fill in (``rounds=True``) and docs/reference.md's column
table are all read from the parts. Adding a column is one field of its part, plus the code that
fills it; or a ``compute=`` function of the row, which results.py's ``write_row`` applies.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, make_dataclass

from harness.column import Column, Part, col
from harness.config import IDENTITY_KEYS, Point
from harness.outcome import Outcome, Verdict, noted, settled
from harness.schema_check import Check, Diagnosis
from harness.schema_effects import EFFECT, SUMMARY  # noqa: F401 (imported from here)
from harness.schema_timing import LAUNCH_BOUND, Contention, Timing, launch_bound  # noqa: F401


def pin_kept(pin, kernel) -> bool | None:
    """Whether the SDPA kernel that ran is the one ``sdpa_backend`` pinned (None: no pin, or no
    SDPA kernel ran)."""
    ran = {k for k in str(kernel or "").split("+") if k in ("flash", "efficient", "cudnn", "math")}
    if pin in (None, "", "auto") or not ran:
        return None
    return ran == {pin}


@dataclass(frozen=True)
class _Identity(Part):
    """What was asked, and what ran: the variant, the point's shape, way and machine keys
    (config.ROLES), and the work one call does."""

    variant: str | None = col("name", "config group choice (`reference`, `fused`, ...)")
    variant_options: str | None = col("text", "the variant's options, `attention=sdpa merge=view`")
    label: str | None = col(
        "text",
        "variant plus option values, `fused/attention=sdpa,merge=view`; plots and tables "
        "group by it",
    )
    variant_target: str | None = col("dotted path", "the class that ran (the yaml's `_target_`)")
    variant_source_hash: str | None = col(
        "hex",
        "sha1 of the file the class is defined in, first 12 digits: two rows with the same "
        "hash ran the same code",
    )
    variant_distribution: str | None = col(
        "text",
        "the installed distribution the class's package comes from, name and version "
        "(`mha-bench 0.1.0`, `timm 1.0.9`); empty for a module on PYTHONPATH",
    )
    fixed: str | None = col(
        "text",
        "what the variant's `_fixed_` declaration put in place of the asked values, "
        "`bias=false (asked true)`; empty when the point ran as asked (the other columns "
        "always say what ran)",
        table=True,
    )
    compile: str | None = col("off/mode", "torch.compile mode")
    mode: str | None = col("name", "fwd, fwd_bwd", table=True)
    batch: int | None = col("count", "B", table=True)
    seq_len: int | None = col("tokens", "L, query length", table=True)
    kv_seq_len: int | None = col("tokens", "S, key/value length", table=True)
    embed_dim: int | None = col("features", "E", table=True)
    num_heads: int | None = col("count", "H", table=True)
    num_kv_heads: int | None = col(
        "count",
        "K/V heads (grouped-query attention when below H); nn.MultiheadAttention computes H of "
        "them, each K/V head repeated for its group",
        table=True,
    )
    kv_cache_len: int | None = col(
        "tokens", "P, keys and values cached before a decode step (empty: no cache)", table=True
    )
    kv_cache: str | None = col(
        "name",
        "decode: how the cache was held, `static` (written in place), `concat` (copied per "
        "step), `none` (no cache: the prefix's keys and values recomputed, nn.MHA); empty "
        "without kv_cache_len",
        table=True,
    )
    window: int | None = col("tokens", "W, keys each query sees with mask=sliding")
    head_dim: int | None = col("features", "D = E / H")
    dtype: str | None = col("name", "float32, float16, bfloat16", table=True)
    device: str | None = col("name", "cpu, cuda, cuda:N (resolved, never `auto`)", table=True)
    mask: str | None = col("name", "none, causal, padding, sliding", table=True)
    mask_format: str | None = col("name", "bool, additive")
    need_weights: bool | None = col("bool", "attention weights returned, checked and timed")
    average_attn_weights: bool | None = col("bool", "weights averaged over heads (else per head)")
    cross: bool | None = col("bool", "key/value separate from query")
    shared_kv: bool | None = col("bool", "cross-attention whose key is its value (one context)")
    bias: str | None = col(
        "bool or layout",
        "projections with bias: true, false, `qkv` (query, key and value only) or `out` "
        "(output only)",
    )
    seed: int | None = col("int", "seed of weights and inputs")
    sdpa_backend: str | None = col("name", "the SDPA pin asked for (`auto`: none)")
    num_threads: int | None = col("count", "torch CPU threads used")
    flops: float | None = col(
        "FLOP", "FLOP model of one call (docs/methodology.md; a feature's own where it changes the "
        "work: latent attention's low-rank projections)"
    )
    bytes_per_call: float | None = col(
        "B",
        "decode: the bytes a step must move at least (weights, the cache's keys and values, the "
        "new ones written, input and output; latent attention's latent cache; the same for every "
        "way at the point); empty "
        "without kv_cache_len",
    )


# A config key that is part of a row's identity (its shape, way or machine: harness/config.py's
# roles) and has no field above gets one, its meaning the key's help: a new key is one field.
Identity = make_dataclass(
    "Identity",
    [
        (f.name, object, col("config key", f.metadata["help"]))
        for f in fields(Point)
        if f.name in IDENTITY_KEYS and f.name not in {g.name for g in fields(_Identity)}
    ],
    bases=(_Identity,),
    frozen=True,
)
Identity.__module__ = __name__  # pickled by name: a record crosses to the job's process


@dataclass(frozen=True)
class Throughput(Part):
    """The timing against the work: TFLOP/s and % of peak; at decode, GB/s and % of copy
    bandwidth."""

    tflops: float | None = col("TFLOP/s", "`flops / latency_ms_median`", table=True, rounds=True)
    peak_tflops: float | None = col(
        "TFLOP/s", "measured dense-matmul peak, this device and dtype", rounds=True
    )
    pct_of_peak: float | None = col("%", "`100 * tflops / peak_tflops`", table=True, rounds=True)
    peak_tflops_datasheet: float | None = col(
        "TFLOP/s", "the GPU's datasheet peak (empty if unknown, and on CPUs)", rounds=True
    )
    pct_of_datasheet_peak: float | None = col(
        "%", "`100 * tflops / peak_tflops_datasheet`", table=True, rounds=True
    )
    gbps: float | None = col(
        "GB/s", "`bytes_per_call / latency_ms_median` (decode)", table=True, rounds=True
    )
    copy_gbps: float | None = col(
        "GB/s",
        "measured copy bandwidth of this device (reads + writes of a large `copy_`; decode)",
        rounds=True,
    )
    pct_of_copy_bw: float | None = col(
        "%", "`100 * gbps / copy_gbps` (decode)", table=True, rounds=True
    )


@dataclass(frozen=True)
class Probe(Part):
    """What ran and what it held (harness/measure/profiling.py)."""

    sdpa_kernel: str | None = col(
        "name",
        "SDPA backend that ran: flash, efficient, cudnn, math, cpu_flash; `flex` for "
        "attention=flex; none",
        table=True,
    )
    sdpa_pin_kept: bool | None = col(
        "bool",
        "`sdpa_backend` pinned and an SDPA kernel ran: whether it is the pinned one (a compiled "
        "graph cached under another pin can ignore it: PyTorch issue 185449); empty otherwise",
        table=True,
        compute=lambda row: pin_kept(row.get("sdpa_backend"), row.get("sdpa_kernel")),
    )
    peak_mem_mb: float | None = col(
        "MiB", "peak memory the call allocated beyond its inputs (docs/methodology.md)", table=True
    )
    scores_materialized: bool | None = col(
        "bool", "the full B·H·L·S score matrix existed in memory", table=True
    )


@dataclass(frozen=True)
class Profile(Part):
    """The profiling pass (``profile=true``, harness/measure/profiling.py)."""

    trace_dir: str | None = col(
        "path", "`profile=true`: the point's trace dir, relative to the run/sweep dir"
    )
    ops_per_call: int | None = col("count", "aten ops per call in the profiling pass")
    copies_per_call: int | None = col("count", "`aten::copy_` per call")
    kernels_per_call: int | None = col("count", "CUDA kernels per call (empty on CPU)")
    top_ops: str | None = col(
        "text", "the five operators with the most self time, with calls per call"
    )
    profile_error: str | None = col(
        "text", "why the profiling pass failed (the row keeps its timing)"
    )


@dataclass(frozen=True)
class Environment(Part):
    """Where the point ran (env.json at the run or sweep root has the rest)."""

    device_name: str | None = col("text", "GPU name, or the CPU model")
    gpus_hidden: int | None = col(
        "count",
        "GPUs the NVIDIA driver has that torch did not see (CUDA_VISIBLE_DEVICES empty, as "
        "submitit's local launcher sets it when asked for no GPU; a CPU-only torch): above 0 on a "
        "`cpu` row, `device=auto` fell back to the CPU on a GPU machine (the log warns)",
    )
    torch_version: str | None = col("text", "`torch.__version__`")
    cuda_version: str | None = col("text", "CUDA torch was built with (empty on CPU builds)")
    git_commit: str | None = col("text", "commit of this checkout, `-dirty` when modified")
    hostname: str | None = col("text", "machine name")


@dataclass(frozen=True)
class Provenance(Part):
    """How the point was asked for: filled where its row is written (harness/sweep/run.py)."""

    overrides: str | None = col("text", "the point's Hydra overrides")
    config_hash: str | None = col(
        "text",
        "fingerprint of the point's full configuration (all keys but `resume`, `report_dir`, "
        "`point_timeout`); `resume=true` matches on it",
    )


# The parts in the CSV's order.
PARTS = {
    "identity": Identity,
    "outcome": Outcome,
    "timing": Timing,
    "contention": Contention,
    "throughput": Throughput,
    "probe": Probe,
    "profile": Profile,
    "check": Check,
    "diagnosis": Diagnosis,
    "environment": Environment,
    "provenance": Provenance,
}
ROW: list[Column] = [c for part in PARTS.values() for c in part.schema()]


@dataclass
class Record:
    """One point's result: a typed part per stage (None: the stage did not run, or not yet), the
    outcome decided as they report (``settle``), and a failure's traceback (not a column: the job
    writes it beside its row)."""

    identity: Identity
    environment: Environment
    outcome: Outcome = field(default_factory=Outcome)
    timing: Timing | None = None
    contention: Contention | None = None
    throughput: Throughput | None = None
    probe: Probe | None = None
    profile: Profile | None = None
    check: Check | None = None
    diagnosis: Diagnosis | None = None
    provenance: Provenance | None = None
    traceback: str = ""

    @property
    def status(self) -> str | None:
        return self.outcome.status

    def settle(self, verdict: Verdict) -> Record:
        """The outcome once ``verdict`` is found (harness/outcome.py's rule); the record."""
        self.outcome = settled(self.outcome, verdict)
        return self

    def note(self, text: str) -> Record:
        """The error with ``text`` added once, its status kept; the record."""
        self.outcome = noted(self.outcome, text)
        return self

    def columns(self) -> dict:
        """Every column by name, in the CSV's order (a part not filled: None): the one place a
        record becomes a dict."""
        row: dict = {}
        for name, part in PARTS.items():
            got = getattr(self, name)
            empty = dict.fromkeys(c.name for c in part.schema())
            row.update(empty if got is None else got.columns())
        return row


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


def check_stands(prior: dict | None, source_hash: str | None) -> bool:
    """Whether the check of ``prior``, the row an earlier run left for this point
    (``resume=true``), still stands: it was ok and the variant's source file is unchanged
    (``variant_source_hash``)."""
    return bool(prior) and prior.get("status") == "ok" and (
        prior.get("variant_source_hash") == source_hash
    )
