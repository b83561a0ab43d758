"""The decode finding says why a step beats the copy bandwidth, and never that its bytes stayed
in a GPU's L2, which the timer flushes before every call."""

from __future__ import annotations

import pandas as pd

from harness.report.findings import decode_finding


def decode_rows(device: str, mib: float, pct: float) -> pd.DataFrame:
    return pd.DataFrame(
        [
            dict(
                status="ok",
                latency_ms_median=0.2,
                variant="fused",
                label="fused/attention=sdpa",
                compile="off",
                kv_cache_len=32768,
                kv_cache="static",
                device=device,
                gbps=3.3e3 * pct / 100,
                copy_gbps=3.3e3,
                pct_of_copy_bw=pct,
                bytes_per_call=mib * 2**20,
                speedup=12.0,
            )
        ]
    )


def test_on_a_gpu_above_copy_is_read_versus_copy_never_the_l2():
    """An H100's decode step of 257 MiB at 140% of the copy's rate: a 50 MB L2, flushed before
    every call, held none of it."""
    text = decode_finding(decode_rows("cuda", 257, 140))
    assert "140% of copy" in text and "stayed" not in text
    assert "a copy writes every byte it reads, a decode step mostly reads" in text


def test_on_a_cpu_only_bytes_that_fit_a_cache_may_have_stayed():
    assert "may have stayed in the CPU's caches" in decode_finding(decode_rows("cpu", 17, 130))
    assert "stayed" not in decode_finding(decode_rows("cpu", 1024, 130))
    assert "mostly reads" not in decode_finding(decode_rows("cpu", 17, 80))  # below: nothing to say
