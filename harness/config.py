"""Typed sweep point: the plain values every stage below ``sweep/run.py`` works with.

``sweep/run.py`` turns the composed Hydra config into a plain dict; ``parse_point`` validates it and
returns a frozen ``Point``, or raises ``InvalidPoint`` with one message naming the bad value.
"""

from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
MASKS = ("none", "causal", "padding")
MASK_FORMATS = ("bool", "additive")
MODES = ("fwd", "fwd_bwd")
COMPILE_MODES = ("off", "default", "reduce-overhead", "max-autotune")
SDPA_BACKENDS = ("auto", "flash", "efficient", "cudnn", "math")


# Every top-level key of conf/config.yaml (README "Config keys") plus the variant group: any
# other key in a composed config is a typo that Hydra's `+key=value` let in, and is refused.
CONF_FILE = Path(__file__).resolve().parent.parent / "conf" / "config.yaml"
TOP_KEYS = tuple(k for k in yaml.safe_load(CONF_FILE.read_text()) if k not in ("defaults", "hydra")) + ("variant",)


def unknown_key_message(raw: dict) -> str | None:
    """"seq_lenn=5 is not a config key (did you mean seq_len?)" for the first unknown key."""
    for key in raw:
        if key not in TOP_KEYS:
            close = difflib.get_close_matches(key, TOP_KEYS, n=1)
            hint = f"did you mean {close[0]}?" if close else 'README "Config keys" lists them'
            return f"{key}={raw[key]!r} is not a config key ({hint})"
    return None


class InvalidPoint(ValueError):
    """A point that cannot be run as asked (bad value); recorded as status ``invalid``."""


@dataclass(frozen=True)
class ProfilerOptions:
    """The profiler pass's schedule and what it records (config key ``profiler``)."""
    wait: int = 1
    warmup: int = 1
    active: int = 3
    repeat: int = 1
    record_shapes: bool = True
    profile_memory: bool = True
    with_stack: bool = False


@dataclass(frozen=True)
class Timing:
    """How a point is timed: in rounds of short repetitions, interleaved with every other point
    of the sweep and paired with nn.MultiheadAttention at the same shape (harness/measure/rounds.py)."""
    warmup: float = 0.05  # s: run the callable at least this long before its first round
    rounds: int = 11  # repetitions per point, spread over the sweep (the interval is over these)
    round_time: float = 0.05  # s: timed calls per repetition (one call at least)
    max_noise: float | None = None  # target relative half-width of the 95% interval; None: by device
    rerun_noise: float = 0.04  # relative sd between two runs that one run's rounds cannot see
    resident_mb: float | None = None  # memory points may hold while they wait for rounds; None: 1/4 of the device's
    flush_l2: bool = True  # CUDA: flush L2 between calls
    cuda_graph: bool = False  # CUDA, mode=fwd: replay the call from a CUDA graph


# What a variant may declare about itself (harness/capabilities.py): in its yaml as
# `_supports_: {key: value or [values], reason: "..."}` and `_fixed_: {key: value}`, or as class
# attributes of the same names. Keys are config keys (plus head_dim); values are checked like the
# config's own.
DECLARATION_KEYS = ("_supports_", "_fixed_")
CAPABILITY_CHOICES = {"mask": MASKS, "mask_format": MASK_FORMATS, "mode": MODES, "dtype": tuple(DTYPES),
                      "device": ("cpu", "cuda"), "compile": COMPILE_MODES, "sdpa_backend": SDPA_BACKENDS}
CAPABILITY_BOOLS = ("bias", "cross", "need_weights", "average_attn_weights")
CAPABILITY_SIZES = ("batch", "seq_len", "kv_seq_len", "embed_dim", "num_heads", "head_dim")
# A fixed value replaces the asked one; sizes, cross and device are left out because other keys'
# validity depends on them (kv_seq_len needs cross; embed_dim must divide by num_heads).
FIXABLE = ("mask", "mask_format", "mode", "dtype", "compile", "sdpa_backend", "bias", "need_weights",
           "average_attn_weights")


def _capability_value(where: str, key: str, value):
    """One declared value, checked like the config key it names (``compile: off`` reads False)."""
    if key == "compile" and (value is False or value is None):
        value = "off"
    if key in CAPABILITY_CHOICES:
        ok = value in CAPABILITY_CHOICES[key]
        allowed = "|".join(CAPABILITY_CHOICES[key])
    elif key in CAPABILITY_BOOLS:
        ok, allowed = isinstance(value, bool), "true|false"
    else:
        ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
        allowed = "a positive integer"
    if not ok:
        raise InvalidPoint(f"{where}.{key}={value!r} is not one of {allowed}")
    return value


def parse_declaration(raw, where: str, kind: str) -> dict:
    """``_supports_`` -> {key: tuple of allowed values, "reason": str}; ``_fixed_`` -> {key: value}.
    ``where`` names the declaration in messages, e.g. "variant=mine: _supports_"."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise InvalidPoint(f"{where} must be a mapping of config keys, not {raw!r}")
    keys = FIXABLE if kind == "_fixed_" else (*CAPABILITY_CHOICES, *CAPABILITY_BOOLS, *CAPABILITY_SIZES)
    out: dict = {}
    for key, value in raw.items():
        if kind == "_supports_" and key == "reason":
            out["reason"] = str(value)
            continue
        if key not in keys:
            close = difflib.get_close_matches(str(key), keys, n=1)
            hint = f"did you mean {close[0]}?" if close else f"one of {', '.join(keys)}"
            raise InvalidPoint(f"{where}.{key} is not a key a variant can declare there ({hint})")
        if kind == "_fixed_":
            out[key] = _capability_value(where, key, value)
        else:
            values = value if isinstance(value, (list, tuple)) else [value]
            if not values:
                raise InvalidPoint(f"{where}.{key} lists no value")
            out[key] = tuple(_capability_value(where, key, v) for v in values)
    return out


@dataclass(frozen=True)
class VariantSpec:
    name: str  # the config group choice, e.g. "fused" (or "mine" from --config-dir)
    target: str  # dotted class path
    options: dict = field(default_factory=dict)  # the yaml's other keys, e.g. {"merge": "view"}
    supports: dict = field(default_factory=dict)  # the yaml's _supports_ (parsed); the class's are added later
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


@dataclass(frozen=True)
class Point:
    variant: VariantSpec
    batch: int
    seq_len: int  # L, query length
    kv_seq_len: int  # S, key/value length (= seq_len unless cross-attention asks otherwise)
    embed_dim: int  # E
    num_heads: int  # H
    dtype: str
    device: str  # resolved: "cpu" or "cuda[:N]" (never "auto")
    mask: str  # none | causal | padding
    mask_format: str  # bool (True = may not attend) | additive (float 0 / -inf, added to scores)
    mode: str  # fwd | fwd_bwd
    need_weights: bool  # ask for (and check) the attention weights
    average_attn_weights: bool  # weights averaged over heads (B, L, S) or per head (B, H, L, S)
    check_only: bool  # check, do not time
    cross: bool  # key/value are tensors other than the query
    bias: bool
    compile: str
    sdpa_backend: str  # auto, or pin F.scaled_dot_product_attention to one backend
    num_threads: int  # torch CPU threads (intra-op)
    seed: int
    timing: Timing = Timing()
    profile: bool = False  # a profiling pass after timing (traces for TensorBoard / Perfetto)
    profiler: ProfilerOptions = ProfilerOptions()
    point_timeout: float | None = 900.0  # s a point may take (set-up and its rounds); None: no limit

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def _positive_int(raw: dict, key: str) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidPoint(f"{key}={value!r} must be a positive integer")
    return value


def _choice(raw: dict, key: str, allowed) -> str:
    value = raw.get(key)
    if value not in allowed:
        raise InvalidPoint(f"{key}={value!r} is not one of {'|'.join(allowed)}")
    return value


def resolve_device(device) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" or device == "cuda" or (
        isinstance(device, str) and device.startswith("cuda:") and device[5:].isdigit()
    ):
        return device
    raise InvalidPoint(f"device={device!r} is not one of auto|cpu|cuda|cuda:N")


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # the cores this process may run on
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _num_threads(value) -> int:
    if value is None:
        return available_cores()
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidPoint(f"num_threads={value!r} must be a positive integer (or null: all cores)")
    return value


def _compile_mode(value) -> str:
    # YAML 1.1 reads a bare `off` as False; accept it rather than surprise the user.
    if value is False or value is None:
        return "off"
    if value not in COMPILE_MODES:
        raise InvalidPoint(f"compile={value!r} is not one of {'|'.join(COMPILE_MODES)}")
    return value


def _bool(raw: dict, key: str) -> bool:
    value = raw.get(key)
    if not isinstance(value, bool):
        raise InvalidPoint(f"{key}={value!r} must be true or false")
    return value


def parse_timing(raw: dict) -> Timing:
    unknown = sorted(set(raw) - set(Timing.__dataclass_fields__))
    if unknown:
        raise InvalidPoint(f"timing.{unknown[0]} is not a timing key ({', '.join(Timing.__dataclass_fields__)})")
    t = Timing(**raw)
    for key in ("warmup", "round_time"):
        value = getattr(t, key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise InvalidPoint(f"timing.{key}={value!r} must be a number of seconds >= 0")
    if isinstance(t.rounds, bool) or not isinstance(t.rounds, int) or t.rounds < 2:
        raise InvalidPoint(f"timing.rounds={t.rounds!r} must be an integer >= 2 (an interval needs two rounds at least)")
    if isinstance(t.rerun_noise, bool) or not isinstance(t.rerun_noise, (int, float)) or not 0 <= t.rerun_noise < 1:
        raise InvalidPoint(f"timing.rerun_noise={t.rerun_noise!r} must be a fraction between 0 and 1")
    if t.max_noise is not None and (isinstance(t.max_noise, bool) or not isinstance(t.max_noise, (int, float))
                                    or not 0 < t.max_noise < 1):
        raise InvalidPoint(f"timing.max_noise={t.max_noise!r} must be a fraction between 0 and 1 (or null)")
    if t.resident_mb is not None and (isinstance(t.resident_mb, bool) or not isinstance(t.resident_mb, (int, float))
                                      or t.resident_mb < 0):
        raise InvalidPoint(f"timing.resident_mb={t.resident_mb!r} must be a number of MiB >= 0 (or null)")
    for key in ("flush_l2", "cuda_graph"):
        if not isinstance(getattr(t, key), bool):
            raise InvalidPoint(f"timing.{key}={getattr(t, key)!r} must be true or false")
    # Against each other: every interval is at least +-sinh(1.96 x rerun_noise) wide (the
    # between-run term), so a smaller noise target could never be met.
    floor = math.sinh(1.959964 * t.rerun_noise)
    if t.max_noise is not None and t.max_noise <= floor:
        raise InvalidPoint(f"timing.max_noise={t.max_noise!r} can never be met with timing.rerun_noise="
                           f"{t.rerun_noise!r}: every interval is at least +-{floor:.3g} (lower rerun_noise "
                           "after measuring it with make stability, or raise max_noise)")
    return t


def parse_profiler(raw: dict) -> ProfilerOptions:
    unknown = sorted(set(raw) - set(ProfilerOptions.__dataclass_fields__))
    if unknown:
        raise InvalidPoint(f"profiler.{unknown[0]} is not a profiler key "
                           f"({', '.join(ProfilerOptions.__dataclass_fields__)})")
    opts = ProfilerOptions(**raw)
    for key in ("wait", "warmup"):
        value = getattr(opts, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidPoint(f"profiler.{key}={value!r} must be an integer >= 0")
    for key in ("active", "repeat"):
        value = getattr(opts, key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise InvalidPoint(f"profiler.{key}={value!r} must be a positive integer")
    for key in ("record_shapes", "profile_memory", "with_stack"):
        if not isinstance(getattr(opts, key), bool):
            raise InvalidPoint(f"profiler.{key}={getattr(opts, key)!r} must be true or false")
    return opts


def parse_point(raw: dict, variant_name: str) -> Point:
    """Validate a plain config dict (the composed config, resolved) into a ``Point``."""
    unknown = unknown_key_message(raw)
    if unknown:
        raise InvalidPoint(unknown)
    variant_cfg = dict(raw.get("variant") or {})
    target = variant_cfg.pop("_target_", None)
    if not target:
        raise InvalidPoint(f"variant={variant_name!r} has no _target_ in its config")
    declared = {kind: parse_declaration(variant_cfg.pop(kind, None), f"variant={variant_name}: {kind}", kind)
                for kind in DECLARATION_KEYS}
    spec = VariantSpec(name=variant_name, target=target, options=variant_cfg,
                       supports=declared["_supports_"], fixed=declared["_fixed_"])

    sizes = {k: _positive_int(raw, k) for k in ("batch", "seq_len", "embed_dim", "num_heads")}
    if sizes["embed_dim"] % sizes["num_heads"]:
        raise InvalidPoint(
            f"embed_dim={sizes['embed_dim']} is not divisible by num_heads={sizes['num_heads']}"
        )
    cross = _bool(raw, "cross")
    kv_seq_len = raw.get("kv_seq_len")
    if kv_seq_len is None:
        kv_seq_len = sizes["seq_len"]
    else:
        kv_seq_len = _positive_int(raw, "kv_seq_len")
        if not cross and kv_seq_len != sizes["seq_len"]:
            raise InvalidPoint(
                f"kv_seq_len={kv_seq_len} differs from seq_len={sizes['seq_len']}: "
                "self-attention has one length (set cross=true for a separate key/value)"
            )
    seed = raw.get("seed")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise InvalidPoint(f"seed={seed!r} must be an integer >= 0")
    timeout = raw.get("point_timeout")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise InvalidPoint(f"point_timeout={timeout!r} must be a number of seconds > 0 (or null: no limit)")
    return Point(
        variant=spec,
        point_timeout=None if timeout is None else float(timeout),
        kv_seq_len=kv_seq_len,
        dtype=_choice(raw, "dtype", tuple(DTYPES)),
        device=resolve_device(raw.get("device")),
        mask=_choice(raw, "mask", MASKS),
        mask_format=_choice(raw, "mask_format", MASK_FORMATS),
        mode=_choice(raw, "mode", MODES),
        need_weights=_bool(raw, "need_weights"),
        average_attn_weights=_bool(raw, "average_attn_weights"),
        check_only=_bool(raw, "check_only"),
        cross=cross,
        bias=_bool(raw, "bias"),
        compile=_compile_mode(raw.get("compile")),
        sdpa_backend=_choice(raw, "sdpa_backend", SDPA_BACKENDS),
        num_threads=_num_threads(raw.get("num_threads")),
        seed=seed,
        timing=parse_timing(dict(raw.get("timing") or {})),
        profile=_bool({"profile": raw.get("profile", False)}, "profile"),
        profiler=parse_profiler(dict(raw.get("profiler") or {})),
        **sizes,
    )
