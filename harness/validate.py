"""Validation of a point's values: ``InvalidPoint`` and the checks that raise it with one line
naming the bad value (harness/config.py's ``Point.__post_init__`` runs them). Knows nothing of
the config's keys beyond what each check is handed."""

from __future__ import annotations

import math

from dataclasses import fields


class InvalidPoint(ValueError):
    """A point that cannot be run as asked (bad value); recorded as status ``invalid``."""


def choice_text(value) -> str:
    """A value as the config writes it: true/false for booleans."""
    return str(value).lower() if isinstance(value, bool) else str(value)


# Every numeric key's ceiling, where its own check sets none: no key has a meaningful value this
# large (a tensor dimension or a count of rounds, threads or steps past 2**31; seconds past 31
# years, MiB past a petabyte, a logit of 1e9), and such a value is a typo or an inf in disguise
# that would hang a point or overflow a tensor later (issue 58).
LARGEST_INT, LARGEST_FLOAT = 2**31, 1e9


def count(value) -> str:
    """A count as labels and progress lines show it: ``2`` for 2 and 2.0, ``2.5`` and ``inf`` as
    they are (``int()`` crashed a sweep's progress line on inf and read page_size=2.5 as 2)."""
    try:
        as_float = float(value)
    except (TypeError, ValueError):
        return str(value)
    if math.isfinite(as_float) and as_float == int(as_float):
        return str(int(as_float))
    return f"{as_float:g}"


def number(
    where: str,
    value,
    low: float,
    *,
    above: bool = False,
    integer: bool = False,
    below: float | None = None,
    none_ok: bool = False,
    unit: str = "",
) -> None:
    """Refuse ``value`` unless it is a finite number (an int if ``integer``) >= low (> low if
    ``above``) and < ``below`` (LARGEST_INT or LARGEST_FLOAT when not given). inf and nan are
    refused everywhere: no key means "no limit" by inf (null does, where a key has no limit),
    and inf seconds of warm-up is a hang."""
    if value is None and none_ok:
        return
    ok = not isinstance(value, bool) and isinstance(value, int if integer else (int, float))
    ok = ok and math.isfinite(value)
    ok = ok and (value > low if above else value >= low) and (below is None or value < below)
    if not ok:
        raise InvalidPoint(f"{where}={value!r} must be {unit}")
    if below is None and value >= (LARGEST_INT if integer else LARGEST_FLOAT):
        ceiling = "2**31" if integer else "1e9"
        raise InvalidPoint(f"{where}={value!r} is too large: it must be below {ceiling}")


def flag(where: str, value) -> None:
    if not isinstance(value, bool):
        raise InvalidPoint(f"{where}={value!r} must be true or false")


def is_choice(value, allowed) -> bool:
    """``value`` is one of ``allowed``; 1 and 0 are not true and false (they compare equal)."""
    return any(value == c and isinstance(value, bool) == isinstance(c, bool) for c in allowed)


def choice(where: str, value, allowed) -> None:
    if not is_choice(value, allowed):
        shown = "|".join(choice_text(c) for c in allowed)
        raise InvalidPoint(f"{where}={value!r} is not one of {shown}")


def known(group: str, raw: dict, cls) -> dict:
    unknown = sorted(set(raw) - {f.name for f in fields(cls)})
    if unknown:
        names = ", ".join(f.name for f in fields(cls))
        raise InvalidPoint(f"{group}.{unknown[0]} is not a {group} key ({names})")
    return raw


def grouped_heads(point, set_) -> None:
    if point.num_kv_heads is None:
        set_("num_kv_heads", point.num_heads)
    number(
        "num_kv_heads",
        point.num_kv_heads,
        0,
        above=True,
        integer=True,
        unit="a positive integer (or null: = num_heads)",
    )
    if point.num_heads % point.num_kv_heads:
        raise InvalidPoint(
            f"num_kv_heads={point.num_kv_heads} does not divide num_heads={point.num_heads} "
            "(each K/V head serves a whole group of query heads)"
        )


def decode(point, set_) -> None:
    """kv_cache_len: one decode step, self-attention, forward only, causal (or sliding)."""
    if point.kv_cache_len is None:
        if point.kv_cache != "static":
            raise InvalidPoint(
                f"kv_cache={point.kv_cache} applies to decode points only (kv_cache_len=null)"
            )
        return
    number(
        "kv_cache_len",
        point.kv_cache_len,
        0,
        above=True,
        integer=True,
        unit="a positive integer (or null: no cache)",
    )
    why = {
        "cross": point.cross is True,
        "kv_seq_len": point.kv_seq_len not in (None, point.kv_cache_len + point.seq_len),
        "mode": point.mode == "fwd_bwd",
    }
    said = {
        "cross": "cross=true: a decode step attends to its own cached keys (self-attention)",
        "kv_seq_len": f"kv_seq_len={point.kv_seq_len}: it is kv_cache_len + seq_len, leave it null",
        "mode": "mode=fwd_bwd: a decode step is inference, mode=fwd",
    }
    for key, bad in why.items():
        if bad:
            raise InvalidPoint(f"kv_cache_len={point.kv_cache_len} with {said[key]}")
    set_("kv_seq_len", point.kv_cache_len + point.seq_len)
    if point.mask == "none":  # the new tokens follow the cache: decoding is causal
        set_("mask", "causal")


def with_mask(point, key: str, mask: str, needs: str) -> bool:
    """Whether ``key`` (a size that belongs to one mask) is in play: refused when set without
    mask=``mask``, required with it (``needs`` says what it is)."""
    value = getattr(point, key)
    if point.mask != mask:
        if value is not None:
            raise InvalidPoint(f"{key}={value!r} applies to mask={mask} only (mask={point.mask})")
        return False
    if value is None:
        raise InvalidPoint(f"mask={mask} needs {needs}")
    return True
