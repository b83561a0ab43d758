"""No ranking, effect or finding compares a device time with an eager call time (issue 56): at a
shape whose ways replayed CUDA graphs, a way whose capture failed (timed between CUDA events, its
eager call) is left out of them, and the report's findings say so."""

from __future__ import annotations

import pandas as pd

from harness.report.analysis import analyze
from harness.results import left_out_by_method, timed_ok


def row(label: str, variant_options: str, ms: float, timed_by: str, seq_len: int = 128) -> dict:
    return dict(
        variant=label.split("/")[0],
        variant_options=variant_options,
        label=label,
        status="ok",
        compile="off",
        sdpa_backend="auto",
        batch=2,
        seq_len=seq_len,
        kv_seq_len=seq_len,
        embed_dim=256,
        num_heads=4,
        dtype="float16",
        device="cuda",
        mask="none",
        mode="fwd",
        latency_ms_median=ms,
        latency_ms_ci_low=0.97 * ms,
        latency_ms_ci_high=1.03 * ms,
        # paired with nn.MHA's replay like for like; none for a way timed otherwise (session.py)
        speedup=0.2 / ms if timed_by == "graph" else None,
        speedup_ci_low=0.2 / ms * 0.97 if timed_by == "graph" else None,
        speedup_ci_high=0.2 / ms * 1.03 if timed_by == "graph" else None,
        timed_by=timed_by,
        graph_error="" if timed_by == "graph" else "not captured in a CUDA graph: RuntimeError",
        noise=0.03,
        noise_target_met=True,
    )


SDPA = ("fused/attention=sdpa,merge=view", "attention=sdpa merge=view")
MANUAL = ("fused/attention=manual,merge=view", "attention=manual merge=view")


def shape(seq_len: int, manual_by: str) -> list[dict]:
    """nn.MHA and SDPA replayed from graphs; manual attention timed as ``manual_by``: its eager
    call (0.05 ms) is slower than its device time would be, and faster than SDPA's device time
    (0.08 ms), so a mixed ranking would crown it."""
    return [
        row("reference", "", 0.2, "graph", seq_len),
        row(*SDPA, 0.08, "graph", seq_len),
        row(*MANUAL, 0.05, manual_by, seq_len),
    ]


def test_a_way_timed_otherwise_than_its_shape_is_left_out_and_said():
    rows = pd.DataFrame(shape(128, "events") + shape(256, "graph"))
    kept = timed_ok(rows)
    assert len(kept) == 5  # the manual way at L=128 only
    assert not ((kept["seq_len"] == 128) & (kept["label"] == MANUAL[0])).any()
    said = left_out_by_method(rows)
    assert said.startswith("1 timed way is left out of the ranking, the effects and the findings")
    assert (
        "timed between CUDA events where the rest of the shape was replayed from a CUDA graph"
        in said
    )

    a = analyze(rows, root=None)
    at_128 = a.ranked[a.ranked["seq_len"].astype(int) == 128].iloc[0]
    assert MANUAL[0] not in str(at_128["contenders"]) and at_128["best"] == SDPA[0]
    at_256 = a.ranked[a.ranked["seq_len"].astype(int) == 256].iloc[0]
    assert at_256["best"] == MANUAL[0]  # like for like there: its device time wins
    assert not a.effects.empty
    assert not (a.effects["seq_len"].astype(int) == 128).any()  # no pair across methods
    timing = [f for f in a.findings if f["factor"] == "timing"]
    assert len(timing) == 1 and timing[0]["text"].startswith("1 timed way is left out")


def test_one_method_at_every_shape_leaves_nothing_out():
    rows = pd.DataFrame(shape(128, "graph") + shape(256, "graph"))
    assert len(timed_ok(rows)) == 6 and left_out_by_method(rows) == ""
    cpu = pd.DataFrame(shape(128, "wall")).assign(timed_by="wall", device="cpu")
    assert len(timed_ok(cpu)) == 3
    assert not any(f["factor"] == "timing" for f in analyze(rows, root=None).findings)
