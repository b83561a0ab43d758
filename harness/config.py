"""The config, defined once: every key, its default, its one-line help and its validation.

``Point`` (with ``Timing`` and ``ProfilerOptions``) is the one definition: its fields are the
config keys, Hydra's schema (harness/store.py) and docs/reference.md (``python -m harness.docs``)
are made from them. ``__post_init__`` validates (harness/validate.py) and resolves (device=auto,
kv_seq_len=null, num_threads=null), raising ``InvalidPoint`` with one line naming the bad value: a
single run exits 2, a sweep records the point as ``invalid`` and goes on (so the schema's types
are ``Any``: OmegaConf would refuse a bad value before the point has a row to keep it in).
"""

from __future__ import annotations

import difflib
import functools
import math
from dataclasses import MISSING, dataclass, field, fields

from harness import envinfo, floors
from harness.validate import (  # noqa: F401 (InvalidPoint, choice_text, is_choice: re-exported)
    InvalidPoint,
    choice,
    choice_text,
    decode,
    flag,
    grouped_heads,
    is_choice,
    known,
    number,
    window,
)


# torch's dtype of each name (Point.torch_dtype); torch is imported where a point needs it, so
# that reading results (mha-bench report, compare) never imports it.
DTYPES = ("float32", "float16", "bfloat16")
MASKS = ("none", "causal", "padding", "sliding")
MASK_FORMATS = ("bool", "additive")
MODES = ("fwd", "fwd_bwd")
KV_CACHES = ("static", "concat")
COMPILE_MODES = ("off", "default", "reduce-overhead", "max-autotune")
# in the order effects take a pair's baseline: the reference implementation first
SDPA_BACKENDS = ("auto", "math", "efficient", "flash", "cudnn")


# bias layouts: every projection, none, the query/key/value projections only (Qwen2's), the
# output projection only. nn.MHA has one flag: the checker's has every bias and zeroes the rest.
BIASES = (True, False, "qkv", "out")


@dataclass(frozen=True)
class VariantSpec:
    name: str  # the config group choice, e.g. "fused" (or "mine" from --config-dir)
    target: str  # dotted class path
    options: dict = field(default_factory=dict)  # the yaml's other keys, e.g. {"merge": "view"}
    # the yaml's _supports_ (parsed); the class's are added later
    supports: dict = field(default_factory=dict)
    fixed: dict = field(default_factory=dict)  # the yaml's _fixed_ (parsed)

    @property
    def label(self) -> str:
        """Name plus its options by name, ``fused/attention=sdpa,merge=view``: rows of one variant
        with different toggles differ, and a legend says which toggle is which."""
        if not self.options:
            return self.name
        return f"{self.name}/" + ",".join(f"{k}={v}" for k, v in sorted(self.options.items()))

    @property
    def options_str(self) -> str:
        return " ".join(f"{k}={v}" for k, v in sorted(self.options.items()))


# What a top-level key is to a row, declared once with the key (``key(role=...)``); every list
# of keys elsewhere (results' WAY_KEYS and SHAPE_KEYS, compare's match, the sweeper's grouping,
# the rounds' shape key, the config hash) is derived from it (docs/architecture.md, "One place
# per key"):
#   shape    defines the point's shape and case: two ways are compared at one shape
#   way      a way of writing attention at a shape (variant, cache style, compile, SDPA pin)
#   machine  where a row ran (CPU threads): part of its identity in a run, not matched across
#            two runs (an A/B usually changes it)
#   measure  how a point is measured (timing, profiling, check_only): not its shape or way, but
#            part of its config hash (it changes the figures)
#   run      how the run goes (resume, timeouts, where reports go): in no identity
ROLES = ("shape", "way", "machine", "measure", "run")


def key(default, help: str, role: str | None = None, choices: tuple | None = None):
    """A config key: its default, its one line of help (docs/reference.md), for a top-level key
    its role (``ROLES``), and for a key with a fixed set of values its ``choices``: validated,
    what a variant may declare (harness/capabilities.py) and ``{choices}`` in the help."""
    if choices is not None:
        if "{choices}" not in help:  # the values are said once, by the tuple
            raise ValueError(f"a key with choices says them with {{choices}} in its help: {help}")
        help = help.replace("{choices}", "|".join(choice_text(c) for c in choices))
    metadata = {"help": help, "role": role, "choices": choices}
    if isinstance(default, type):  # a nested group of keys
        return field(default_factory=default, metadata=metadata)
    return field(default=default, metadata=metadata)


def choices_of(cls=None) -> dict[str, tuple]:
    """Every key with a fixed set of values, and its values (``key(choices=...)``)."""
    return {
        f.name: f.metadata["choices"]
        for f in fields(cls or Point)
        if f.metadata.get("choices") is not None
    }


# timing.rerun_noise=null: the between-run floor of the device kind earned from re-runs (make
# stability, make gpu-check STEP=stability: harness/floors.json, with its date and machine),
# widened where the run's own rounds measure more (stats.drift_floor); where none was earned,
# these assumed values (docs/methodology.md, "How a point is timed").
ASSUMED_FLOOR = {"cpu": 0.04, "cuda": 0.02}
CUDA_FLOOR = ASSUMED_FLOOR["cuda"]


def no_narrower(max_noise: float | None, device: str) -> None:
    """``timing.max_noise`` with ``rerun_noise=null``: above the floor every interval on
    ``device`` has at least (the earned or assumed one), or refused."""
    floor, source = rerun_floor(device)
    least = math.sinh(1.959964 * floor)
    if max_noise is not None and max_noise <= least:
        raise InvalidPoint(
            f"timing.max_noise={max_noise!r} can never be met with the {source} between-run "
            f"floor {floor:.4g} on {device} (harness/floors.json): every interval is at least "
            f"+-{least:.3g} (raise max_noise, or set timing.rerun_noise after make stability)"
        )


def rerun_floor(device: str, in_run: float | None = None) -> tuple[float, str]:
    """The between-run floor of a point on ``device`` with ``timing.rerun_noise=null``, and where
    it comes from: ``earned`` (floors.json), ``rounds`` (``in_run``, measured from the run's
    rounds, is larger and widens it) or ``assumed`` (nothing earned for the device kind)."""
    kind = "cuda" if str(device).startswith("cuda") else "cpu"
    earned = floors.earned(kind)
    return floors.floor_rule(earned.value if earned else None, in_run, ASSUMED_FLOOR[kind])


@dataclass(frozen=True)
class Timing:
    """How a point is timed: in rounds of short repetitions, interleaved with every other point
    of the sweep and paired with nn.MultiheadAttention at the same shape (docs/methodology.md)."""

    warmup: float = key(0.05, "s, warm-up by time before the first round (at least 2 calls)")
    rounds: int = key(
        11,
        "repetitions per point, spread over the sweep; the 95% intervals come "
        "from their spread (2 at least)",
    )
    round_time: float = key(0.05, "s, timed calls per repetition (at least one call)")
    retime_rounds: int = key(
        11,
        "rounds after `rounds` that re-time the repetitions contention spoiled (other processes "
        "taking the cores, the hypervisor, another process on the GPU); they stop after 2 in a row "
        "that half their repetitions or more spoiled again; 0: none (docs/methodology.md)",
    )
    max_noise: float | None = key(
        None,
        "target relative half-width of the interval; null: 0.10 "
        "(must be above the floor rerun_noise puts under every interval, sinh(1.96 x rerun_noise))",
    )
    rerun_noise: float | None = key(
        None,
        "relative sd between two runs that one run's rounds cannot see; null: the device kind's "
        "floor earned from re-runs (harness/floors.json, make stability), widened where the "
        "run's rounds drift more (docs/methodology.md)",
    )
    resident_mb: float | None = key(
        None, "MiB points may hold while waiting for their rounds; null: 1/4 of the device's memory"
    )
    flush_l2: bool = key(True, "CUDA: flush L2 before every call (outside the timed region)")
    cuda_graph: bool = key(
        True,
        "CUDA: time device time by capturing the call once in a CUDA graph and replaying it (no "
        "launch gaps), beside the eager call time; false: the eager call's events only",
    )

    def __post_init__(self):
        for name in ("warmup", "round_time"):
            number(f"timing.{name}", getattr(self, name), 0, unit="a number of seconds >= 0")
        number(
            "timing.rounds",
            self.rounds,
            2,
            integer=True,
            unit="an integer >= 2 (an interval needs two rounds at least)",
        )
        number(
            "timing.rerun_noise",
            self.rerun_noise,
            0,
            below=1,
            none_ok=True,
            unit="a fraction between 0 and 1 (or null: by device)",
        )
        number(
            "timing.max_noise",
            self.max_noise,
            0,
            above=True,
            below=1,
            none_ok=True,
            unit="a fraction between 0 and 1 (or null)",
        )
        number(
            "timing.resident_mb",
            self.resident_mb,
            0,
            none_ok=True,
            unit="a number of MiB >= 0 (or null)",
        )
        number(
            "timing.retime_rounds",
            self.retime_rounds,
            0,
            integer=True,
            unit="an integer >= 0 (rounds that re-time spoiled repetitions)",
        )
        flag("timing.flush_l2", self.flush_l2)
        flag("timing.cuda_graph", self.cuda_graph)
        # Against each other: every interval is at least +-sinh(1.96 x rerun_noise) wide (the
        # between-run term), so a smaller noise target could never be met.
        floor = math.sinh(1.959964 * (self.rerun_noise or 0))
        if self.max_noise is not None and self.rerun_noise is not None and self.max_noise <= floor:
            raise InvalidPoint(
                f"timing.max_noise={self.max_noise!r} can never be met with timing.rerun_noise="
                f"{self.rerun_noise!r}: every interval is at least +-{floor:.3g} (lower "
                "rerun_noise after measuring it with make stability, or raise max_noise)"
            )


@dataclass(frozen=True)
class ProfilerOptions:
    """The profiler pass's schedule and what it records (config key ``profiler``)."""

    wait: int = key(1, "schedule: steps skipped per cycle")
    warmup: int = key(1, "schedule: steps run, not recorded, after those")
    active: int = key(3, "schedule: steps recorded per cycle")
    repeat: int = key(1, "cycles")
    record_shapes: bool = key(True, "record the ops' input shapes")
    profile_memory: bool = key(True, "record memory allocations")
    with_stack: bool = key(False, "record Python stacks (larger traces)")

    def __post_init__(self):
        for name in ("wait", "warmup"):
            number(f"profiler.{name}", getattr(self, name), 0, integer=True, unit="an integer >= 0")
        for name in ("active", "repeat"):
            number(
                f"profiler.{name}",
                getattr(self, name),
                0,
                above=True,
                integer=True,
                unit="a positive integer",
            )
        for name in ("record_shapes", "profile_memory", "with_stack"):
            flag(f"profiler.{name}", getattr(self, name))


@dataclass(frozen=True)
class Point:
    """One point of a sweep: the config's keys, validated and resolved. ``variant`` is the
    config group (conf/variant/<name>.yaml), typed into a ``VariantSpec`` by ``parse_point``."""

    variant: VariantSpec | None = key(
        None,
        "config group: a file of conf/variant (or DIR/variant "
        "with --config-dir DIR); default fused",
        role="way",
    )
    batch: int = key(2, "B, sequences per call", role="shape")
    seq_len: int = key(128, "L, query length", role="shape")
    cross: bool = key(False, "true: key/value are separate tensors (cross-attention)", role="shape")
    kv_seq_len: int | None = key(
        None,
        "S, key/value length when cross=true (null: = seq_len, or kv_cache_len + seq_len)",
        role="shape",
    )
    kv_cache_len: int | None = key(
        None,
        "decode: P keys and values already cached; the seq_len new tokens attend to them and "
        "causally to each other (null: no cache); with mask=padding the prompts in the cache are "
        "left-padded. Refused with cross=true, mode=fwd_bwd or a kv_seq_len (it becomes P + "
        "seq_len)",
        role="shape",
    )
    kv_cache: str = key(
        "static",
        "{choices}, with kv_cache_len: how a variant with a KV cache holds it (static: "
        "preallocated, written in place; concat: torch.cat per step); nn.MultiheadAttention has "
        "none (concat: unsupported); concat without kv_cache_len is refused",
        role="way",
        choices=KV_CACHES,
    )
    embed_dim: int = key(256, "E", role="shape")
    num_heads: int = key(4, "H (head_dim = E / H)", role="shape")
    num_kv_heads: int | None = key(
        None,
        "K/V heads: fewer than num_heads is grouped-query attention, 1 multi-query; must divide "
        "num_heads (null: = num_heads)",
        role="shape",
    )
    bias: bool | str = key(
        True,
        "{choices}: the projections with biases (true: all; qkv: the query, key and value "
        "projections only, as Qwen2; out: the output projection only); nn.MHA is checked with "
        "the others zeroed",
        role="shape",
        choices=BIASES,
    )
    dtype: str = key("float32", "{choices}", role="shape", choices=DTYPES)
    device: str = key("auto", "auto (cuda when available) | cpu | cuda | cuda:N", role="shape")
    mask: str = key(
        "none",
        "{choices} (padding: some keys of every batch row padded; sliding: causal, each query "
        "sees itself and the window-1 keys before it); with kv_cache_len: none reads causal",
        role="shape",
        choices=MASKS,
    )
    window: int | None = key(
        None,
        "W, keys each query sees with mask=sliding (itself included); required by it, refused "
        "without it",
        role="shape",
    )
    mask_format: str = key(
        "bool",
        "{choices} (bool: True = may not attend; additive: float 0 / -inf added to scores)",
        role="shape",
        choices=MASK_FORMATS,
    )
    mode: str = key(
        "fwd",
        "{choices} (fwd_bwd: forward + backward, gradients checked and timed too)",
        role="shape",
        choices=MODES,
    )
    need_weights: bool = key(
        False,
        "also return, check and time the attention weights (nn.MHA's slow path)",
        role="shape",
    )
    average_attn_weights: bool = key(
        True, "weights averaged over heads, or per head when false", role="shape"
    )
    check_only: bool = key(
        False,
        "check only, no timing; exit non-zero if any point fails its check",
        role="measure",
    )
    check_max_logit: float | None = key(
        100.0,
        "the activation-scale check: each point is checked once more with a few outlier channels "
        "of its inputs scaled up until nn.MHA's largest attention logit is this (a softmax "
        "that does not subtract its row max overflows there); null: no such check "
        "(docs/methodology.md, Two scales)",
        role="measure",
    )
    check_sample_rows: int | None = key(
        None,
        "query rows the check compares with the float64 oracle: n (>= 2) rows where seq_len > n "
        "(the first and last, a window's edge, the rest at seeded places spread over the "
        "sequence); 0: every row; null: every row up to seq_len 1024, 128 above. The module "
        "still runs on every row; in fwd_bwd its grad_out is zero outside them, so every "
        "gradient is compared exactly; decode points compare every row "
        "(docs/methodology.md, Checks at long sequences)",
        role="measure",
    )
    compile: str = key("off", "{choices} (torch.compile mode)", role="way", choices=COMPILE_MODES)
    sdpa_backend: str = key(
        "auto",
        "{choices}: pin F.scaled_dot_product_attention",
        role="way",
        choices=SDPA_BACKENDS,
    )
    num_threads: int | None = key(
        None,
        "torch CPU threads; null: on a CPU half the cores this process may use (one busy "
        "process beside the run then leaves its rounds clean), on a GPU every core",
        role="machine",
    )
    seed: int = key(0, "weights and inputs are drawn from this seed", role="shape")
    timing: Timing = key(
        Timing, "points are timed in interleaved rounds spread over the sweep", role="measure"
    )
    profile: bool = key(
        False,
        "a torch.profiler pass after timing: traces for TensorBoard and Perfetto",
        role="measure",
    )
    profiler: ProfilerOptions = key(
        ProfilerOptions, "the profiler pass's schedule and records", role="measure"
    )
    point_timeout: float | None = key(
        900.0,
        "s a point may take (build, check, compile, warm-up, "
        "its rounds); past it: status timeout; null: no limit",
        role="run",
    )
    resume: bool = key(
        False,
        "re-running a sweep in its old dir: keep its finished checks and rounds, run what is left",
        role="run",
    )
    report_dir: str = key(
        "reports",
        "where the HTML report is copied (relative to the working dir)",
        role="run",
    )

    def __post_init__(self):
        set_ = functools.partial(object.__setattr__, self)  # frozen: normalise in place, once
        # YAML 1.1 reads a bare `off` as False; accept it rather than surprise the user.
        set_("compile", "off" if self.compile is False or self.compile is None else self.compile)
        for name, allowed in choices_of(Point).items():
            choice(name, getattr(self, name), allowed)
        for name in ("batch", "seq_len", "embed_dim", "num_heads"):
            number(
                name, getattr(self, name), 0, above=True, integer=True, unit="a positive integer"
            )
        if self.embed_dim % self.num_heads:
            raise InvalidPoint(
                f"embed_dim={self.embed_dim} is not divisible by num_heads={self.num_heads}"
            )
        flag("cross", self.cross)
        grouped_heads(self, set_)
        decode(self, set_)
        if self.kv_seq_len is None:
            set_("kv_seq_len", self.seq_len)
        else:
            number(
                "kv_seq_len",
                self.kv_seq_len,
                0,
                above=True,
                integer=True,
                unit="a positive integer",
            )
            if not self.cross and self.kv_cache_len is None and self.kv_seq_len != self.seq_len:
                raise InvalidPoint(
                    f"kv_seq_len={self.kv_seq_len} differs from seq_len={self.seq_len}: "
                    "self-attention has one length (set cross=true for a separate key/value)"
                )
        number("seed", self.seed, 0, integer=True, unit="an integer >= 0")
        number(
            "check_max_logit",
            self.check_max_logit,
            0,
            above=True,
            none_ok=True,
            unit="a positive number (the largest attention logit), or null: no activation-scale "
            "check",
        )
        # 0 (every row) or at least 2 (the first and the last row)
        every_row = self.check_sample_rows == 0 and type(self.check_sample_rows) is int
        number(
            "check_sample_rows",
            None if every_row else self.check_sample_rows,
            2,
            integer=True,
            none_ok=True,
            unit="an integer >= 2 (query rows compared), 0 (every row) or null (automatic)",
        )
        number(
            "point_timeout",
            self.point_timeout,
            0,
            above=True,
            none_ok=True,
            unit="a number of seconds > 0 (or null: no limit)",
        )
        if self.point_timeout is not None:
            set_("point_timeout", float(self.point_timeout))
        set_("device", envinfo.resolve_device(self.device))
        window(self)
        for name in (
            "need_weights",
            "average_attn_weights",
            "check_only",
            "profile",
            "resume",
        ):
            flag(name, getattr(self, name))
        if self.num_threads is None:
            set_("num_threads", envinfo.default_threads(self.device))
        number(
            "num_threads",
            self.num_threads,
            0,
            above=True,
            integer=True,
            unit="a positive integer (or null: all cores)",
        )
        if isinstance(self.timing, dict):
            set_("timing", Timing(**known("timing", self.timing, Timing)))
        if isinstance(self.timing, Timing) and self.timing.rerun_noise is None:
            no_narrower(self.timing.max_noise, self.device)
        if isinstance(self.profiler, dict):
            set_("profiler", ProfilerOptions(**known("profiler", self.profiler, ProfilerOptions)))

    @property
    def in_bias(self) -> bool:
        """The query, key and value projections have biases (``bias``: true or qkv)."""
        return self.bias in (True, "qkv")

    @property
    def out_bias(self) -> bool:
        """The output projection has a bias (``bias``: true or out)."""
        return self.bias in (True, "out")

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def groups(self) -> int:
        """Query heads per K/V head (1: every head has its own)."""
        return self.num_heads // self.num_kv_heads

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)


def keys_with(*roles: str) -> tuple[str, ...]:
    """The top-level keys of these roles (``ROLES``), in the config's order."""
    return tuple(f.name for f in fields(Point) if f.metadata.get("role") in roles)


# Keys that change no measurement: left out of the config hash (a resumed sweep's rows match).
RUN_ONLY = keys_with("run")
# A row's identity: its shape, its way of writing attention and the machine it ran on (the row's
# columns, harness/point/'s identity, harness/schema.py's columns for keys without their own).
IDENTITY_KEYS = keys_with("shape", "way", "machine")

# The top-level config keys; any other key in a composed config is a typo.
TOP_KEYS = tuple(f.name for f in fields(Point))


def unknown_key_message(raw: dict) -> str | None:
    """ "seq_lenn=5 is not a config key (did you mean seq_len?)" for the first unknown key."""
    for name in raw:
        if name not in TOP_KEYS:
            close = difflib.get_close_matches(name, TOP_KEYS, n=1)
            hint = f"did you mean {close[0]}?" if close else "docs/reference.md lists them"
            return f"{name}={raw[name]!r} is not a config key ({hint})"
    return None


def defaults(cls=Point) -> dict:
    """Every key's default, nested groups as dicts: what conf/config.yaml starts from."""
    out = {}
    for f in fields(cls):
        if f.default_factory is not MISSING:
            out[f.name] = defaults(f.default_factory)
        elif f.name != "variant":
            out[f.name] = f.default
    return out
