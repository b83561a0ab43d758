"""Progress and one-line results for long sweeps: "[3/16 0:12 elapsed, ~0:40 left] ok fused/...".

The Hydra callback starts the clock and counts the sweep's points when the multirun starts;
each job reads its place from its own job number. With a launcher that runs jobs in other
processes (joblib, submitit) the count is not shared and the line shows only the job number.
"""

from __future__ import annotations

import time

from harness import features
from harness.config import KV_CACHES
from harness.results import cache_text
from harness.validate import count


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class Progress:
    def __init__(self) -> None:
        self.total: int | None = None
        self.started: float | None = None
        self.queued_s = 0.0  # expected timing-round seconds of the points queued so far

    def begin(self, total: int | None) -> None:
        self.total, self.started, self.queued_s = total, time.monotonic(), 0.0

    def queue(self, seconds: float) -> None:
        """A point was queued for the timing rounds after the last job: they will take about
        ``seconds`` for it, so the estimate of what is left includes them."""
        self.queued_s += seconds

    def prefix(self, job_num: int | None) -> str:
        """Progress after job ``job_num`` (0-based) finished; empty for a single run."""
        if job_num is None:
            return ""
        if self.started is None or not self.total:
            return f"[job {job_num}] "
        done = job_num + 1
        elapsed = time.monotonic() - self.started
        # the remaining jobs at the pace so far, plus the rounds of every point (extrapolated)
        left = elapsed / done * max(self.total - done, 0) + self.queued_s * self.total / done
        width = len(str(self.total))
        return f"[{done:>{width}}/{self.total} {_clock(elapsed)} elapsed, ~{_clock(left)} left] "


PROGRESS = Progress()


def _g(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def case(row: dict) -> str:
    """The point's shape and case in one short string: B=2 L=128 E=256 H=4 float32 cpu mask=none."""

    def on(key, default):  # show a field only when it differs from the usual
        value = row.get(key)
        return (
            value is not None
            and not (isinstance(value, float) and value != value)
            and value != default
        )

    text = f"B={row.get('batch')} L={row.get('seq_len')}"
    if on("cross", False):
        text += f" S={row.get('kv_seq_len')} cross" + (" kv=one" if on("shared_kv", False) else "")
    if on("kv_cache_len", None):  # decode: the new tokens follow P cached ones
        text += f" P={count(row['kv_cache_len'])}"
    text += f" E={row.get('embed_dim')} H={row.get('num_heads')}"
    if on("num_kv_heads", row.get("num_heads")):  # grouped-query: fewer K/V heads
        text += f" Hkv={count(row['num_kv_heads'])}"
    text += f" {row.get('dtype')} {row.get('device')}"
    text += f" mask={row.get('mask')}"
    text += features.case(row)  # each model feature's words (harness/features/)
    text += (
        f" ({row.get('mask_format')})"
        if on("mask_format", "bool") and row.get("mask") != "none"
        else ""
    )
    for key, default in (
        ("mode", "fwd"),
        ("compile", "off"),
        ("bias", True),
        ("need_weights", False),
    ):
        text += f" {key}={row.get(key)}" if on(key, default) else ""
    if on("need_weights", False) and row.get("average_attn_weights") is False:
        text += " per-head"
    return text


def _present(value) -> bool:
    return value is not None and value == value


def _interval(row: dict, prefix: str, fmt: str = ".4g") -> str:
    """ " [low, high]" for a 95% interval, or nothing when the row has none."""
    low, high = row.get(f"{prefix}_ci_low"), row.get(f"{prefix}_ci_high")
    return f" [{low:{fmt}}, {high:{fmt}}]" if _present(low) and _present(high) else ""


def result_line(row: dict) -> str:
    """One line per point: verdict, variant, shape, latency, error against the oracle."""
    parts = [f"{row.get('status') or '?':<11}", f"{row.get('label') or row.get('variant')}"]
    decode = row.get("kv_cache_len") is not None and row.get("kv_cache_len") == row.get(
        "kv_cache_len"
    )
    if decode and row.get("kv_cache") in (*KV_CACHES, "none"):  # how it holds it
        parts[-1] += f" cache={cache_text(row)}"
    parts.append(case(row))
    if row.get("fixed"):  # the variant's _fixed_ changed what was asked: say so on the line
        parts.append(f"[fixed: {row['fixed']}]")
    if _present(row.get("latency_ms_median")):
        parts.append(
            f"{row['latency_ms_median']:.4g} ms{_interval(row, 'latency_ms')} "
            f"(n={row['n_samples']})"
        )
    if _present(row.get("speedup")):
        parts.append(f"{row['speedup']:.3g}x nn.MHA{_interval(row, 'speedup', '.3g')}")
    if row.get("contended") is True and _present(row.get("latency_ms_median")):
        # its rounds stayed contended: the figures on this line are the busy machine's
        parts.append("(busy: timed on a busy machine, these figures decide nothing)")
    if row.get("max_abs_err") is not None:
        # the numbers; a drop-in fault says why below
        verdict = "<=" if row["max_abs_err"] <= row["tolerance"] else ">"
        parts.append(
            f"err {_g(row['max_abs_err'])} {verdict} tol {_g(row['tolerance'])} "
            f"({row.get('worst_tensor')})"
        )
    # the first call compiled (compile=..., attention=flex): apart from timing
    if _present(row.get("compile_s")):
        parts.append(f"compiled {row['compile_s']:.3g} s")
    if row.get("leak") is True:
        parts.append(f"LEAK: +{row['mem_growth_mb']:.3g} MiB over its timed calls")
    if row.get("status") == "mismatch" and row.get("error"):  # the check's whole sentence
        parts.append(f"-- {row['error']}")
    elif row.get("status") != "ok" and row.get("error"):  # a compiler's error runs to pages
        short = first_line(row["error"])
        parts.append(
            f"-- {short}" + (" (the whole text: errors.log)" if short != row["error"] else "")
        )
    return "  ".join(parts)


SHORT = 160  # characters of a reason kept on its one line


def first_line(text, limit: int = SHORT) -> str:
    """A reason's first line, cut to ``limit`` characters with an ellipsis, words whole ("not a
    wrong r…" read as a word): before the raw text an explanation brackets (errors.py's "meaning
    [raw]"), else at the last space; mid-token only where one token fills most of the line."""
    text = "" if text is None or text != text else str(text).strip()
    line = (text.splitlines() or [""])[0]
    if len(line) <= limit:
        return line
    cut = line[: limit - 1]
    bracket, space = cut.rfind(" ["), cut.rfind(" ")
    at = bracket if bracket > limit // 2 else space
    return (cut[:at] if at > limit // 2 else cut).rstrip(" ,;:") + "…"


def headline(doc: str | None) -> str:
    """A module docstring's first paragraph as one line: a command's ``--help`` description
    (its first line alone stopped mid-sentence)."""
    first = (doc or "").strip().split("\n\n", 1)[0]
    return " ".join(first.split())
