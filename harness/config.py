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
from dataclasses import MISSING, dataclass, field, fields, replace

from harness import envinfo, features
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
)


# torch's dtype of each name (Point.torch_dtype); torch is imported where a point needs it, so
# that reading results (mha-bench report, compare) never imports it.
DTYPES = ("float32", "float16", "bfloat16")
# the masks and cache styles, and those the model features add (harness/features/)
MASKS = features.choices("mask", ("none", "causal", "padding"))
MASK_FORMATS = ("bool", "additive")
MODES = ("fwd", "fwd_bwd")
KV_CACHES = features.choices("kv_cache", ("static", "concat"))
# A decode point's cache has room for this many steps of L tokens beyond its P: the two checked
# steps and one more, so that returning the whole buffer is never the right answer by chance.
CACHE_STEPS = 3
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


from harness.keys import ROLES, key  # noqa: E402,F401 (re-exported: the keys' vocabulary)


def choices_of(cls=None) -> dict[str, tuple]:
    """Every key with a fixed set of values, and its values (``key(choices=...)``)."""
    return {
        f.name: f.metadata["choices"]
        for f in fields(cls or Point)
        if f.metadata.get("choices") is not None
    }


from harness.config_measure import (  # noqa: E402,F401 (re-exported: how a point is measured)
    ASSUMED_FLOOR,
    CUDA_FLOOR,
    ProfilerOptions,
    Timing,
    no_narrower,
    rerun_floor,
)


@dataclass(frozen=True)
@features.keyed  # each model feature's keys (harness/features/), after the key each names
class Point:
    """One point of a sweep: the config's keys, validated and resolved. ``variant`` is the
    config group (conf/variant/<name>.yaml), typed into a ``VariantSpec`` by ``parse_point``;
    a model feature's keys are declared in its own module (harness/features/)."""

    variant: VariantSpec | None = key(
        None,
        "config group: a file of conf/variant (or DIR/variant "
        "with --config-dir DIR); default fused",
        role="way",
    )
    batch: int = key(2, "B, sequences per call", role="shape")
    seq_len: int = key(128, "L, query length", role="shape")
    cross: bool = key(False, "true: key/value are separate tensors (cross-attention)", role="shape")
    shared_kv: bool = key(
        False,
        "with cross=true: the key is the value, one context tensor (a single-context "
        "cross-attention, as diffusers' and BERT's take it)",
        role="shape",
    )
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
        "preallocated, written in place; concat: torch.cat per step"
        + features.said("kv_cache")
        + "); nn.MultiheadAttention has none (only static runs it, and says kv_cache=none); any "
        "other style without kv_cache_len is refused",
        role="way",
        choices=KV_CACHES,
    )
    embed_dim: int = key(256, "E", role="shape")
    num_heads: int = key(4, "H (head_dim = E / H)", role="shape")
    num_kv_heads: int | None = key(
        None,
        "K/V heads: fewer than num_heads is grouped-query attention, 1 multi-query; must divide "
        "num_heads (null: = num_heads)",
        role="model",
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
        "{choices} (padding: some keys of every batch row padded"
        + features.said("mask")
        + "); with kv_cache_len: none reads causal",
        role="model",
        choices=MASKS,
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
        flag("shared_kv", self.shared_kv)
        if self.shared_kv and not self.cross:
            raise InvalidPoint(
                "shared_kv=true is a cross-attention whose key is its value: set cross=true "
                "(self-attention's key and value are the query already)"
            )
        for feature in features.registry():  # its keys, and what they combine with
            feature.check(self, set_)
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
        number("seed", self.seed, 0, integer=True, below=2**63, unit="an integer 0 .. 2**63-1")
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
            below=4097,  # past any machine's cores; a million threads is a crash, not a run
            unit="a positive integer up to 4096 (or null: all cores)",
        )
        if isinstance(self.timing, dict):
            set_("timing", Timing(**known("timing", self.timing, Timing)))
        if isinstance(self.timing, Timing) and self.timing.rerun_noise is None:
            no_narrower(self.timing.max_noise, self.device)
        if isinstance(self.timing, Timing) and self.point_timeout is not None:
            for name in ("warmup", "round_time"):  # one repetition past the hang limit: a hang
                if getattr(self.timing, name) >= self.point_timeout:
                    raise InvalidPoint(
                        f"timing.{name}={getattr(self.timing, name)!r} s is not below "
                        f"point_timeout={self.point_timeout:g} s: every point would time out"
                    )
            rounds_s = self.timing.rounds * self.timing.round_time  # a point's time in its rounds
            if rounds_s >= self.point_timeout:
                raise InvalidPoint(
                    f"timing.rounds={self.timing.rounds} of timing.round_time="
                    f"{self.timing.round_time:g} s take {rounds_s:g} s, not below point_timeout="
                    f"{self.point_timeout:g} s: every point would time out"
                )
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
    def hides_later_keys(self) -> bool:
        """Every mask but none and padding hides the keys after a query: the work models count
        half the pairs (harness/flops.py; an upper bound where a window or a feature hides more)."""
        return self.mask not in ("none", "padding")

    @property
    def cache_capacity(self) -> int:
        """Tokens a decode point's KV cache has room for: P and ``CACHE_STEPS`` steps of L."""
        return (self.kv_cache_len or 0) + CACHE_STEPS * self.seq_len

    @property
    def groups(self) -> int:
        """Query heads per K/V head (1: every head has its own)."""
        return self.num_heads // self.num_kv_heads

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    def shape_key(self) -> "Point":
        """What pairs a way with its reference, and what shares nn.MHA's own error and the check's
        yardsticks: the point less the way of writing it (variant and options, compile, SDPA pin,
        KV cache style) and how it is measured, each such key (``ROLES``) at its default (a group
        of keys, timing and profiler, at None)."""
        others = {
            f.name: None if f.default is MISSING else f.default
            for f in fields(Point)
            if f.metadata.get("role") in ("way", "measure", "run")
        }
        return replace(self, **others)


def keys_with(*roles: str) -> tuple[str, ...]:
    """The top-level keys of these roles (``ROLES``), in the config's order."""
    return tuple(f.name for f in fields(Point) if f.metadata.get("role") in roles)


# Keys that change no measurement: left out of the config hash (a resumed sweep's rows match).
RUN_ONLY = keys_with("run")
# A row's identity: its shape, its way of writing attention and the machine it ran on (the row's
# columns, harness/point/'s identity, harness/schema.py's columns for keys without their own).
IDENTITY_KEYS = keys_with("shape", "model", "way", "machine")

# The top-level config keys; any other key in a composed config is a typo.
TOP_KEYS = tuple(f.name for f in fields(Point))


# Keys users reach for that are none here, said in one line instead of a near name: a model
# nn.MultiheadAttention cannot express (no oracle checks it, so it is refused with why, issue 59,
# not checked against a home-made oracle), or another name for keys that are here.
_SOFTCAP = (
    "tanh softcapping of the scores (Gemma 2, Grok) is no mask nn.MultiheadAttention can add, so "
    "no oracle checks it: unsupported"
)
# Latent attention's names in the models' configs, and the keys that say them here.
_MLA = (
    "multi-head latent attention is kv_lora_rank=r (q_lora_rank, latent_rope_dim, "
    "latent_v_dim: DeepSeek's v_head_dim; its qk head is head_dim = embed_dim / num_heads)"
)
NO_ORACLE = {
    **dict.fromkeys(("softcap", "logit_softcap", "attn_logit_softcapping"), _SOFTCAP),
    **dict.fromkeys(("mla", "qk_head_dim", "v_head_dim", "qk_rope_head_dim"), _MLA),
}


def no_oracle(name: str) -> str | None:
    """Why ``name`` is no config key where it names a model no oracle checks, else None."""
    return f"{name} is not a config key: {NO_ORACLE[name]}" if name in NO_ORACLE else None


def unknown_key_message(raw: dict) -> str | None:
    """ "seq_lenn=5 is not a config key (did you mean seq_len?)" for the first unknown key."""
    for name in raw:
        if name not in TOP_KEYS:
            if no_oracle(name):
                return no_oracle(name)
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
