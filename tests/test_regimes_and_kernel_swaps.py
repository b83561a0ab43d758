"""On a GPU the findings say which regime each shape is in (eager call time against device time)
and give the eager comparison its own sentence where it differs; a pair of ways whose attention
kernel changed where the factor does not choose it (Inductor turning compiled manual attention
into cuDNN SDPA) is labelled in effects.csv, summed up apart, and said so. Hand-built rows: no GPU,
no torch.compile."""

import math

import pandas as pd
import pytest

from harness import schema
from harness.sweep.facts import ways_of
from harness.report import analysis, effects, findings
from harness.report.render import launch_bound_note

B_HOST, B_GPU = 1024, 8192  # seq_len of the launch-bound shape and of the GPU-bound one


def analyze(df: pd.DataFrame) -> analysis.Analysis:
    """The analysis a run's end makes: its ways named from the registries (sweep/facts.py)."""
    return analysis.analyze(df, ways=ways_of(df))


def gpu_row(label, seq_len, device_ms, eager_ms, **keys):
    """A timed CUDA row as the harness writes it: device time from a CUDA-graph replay, the eager
    call time beside it, both paired with nn.MHA (``ref``: nn.MHA's device and eager times)."""
    variant, _, options = label.partition("/")
    ref_device, ref_eager = keys.pop("ref", (0.10 * seq_len / 1024, 0.2))
    row = dict(
        variant=variant,
        variant_options=options.replace(",", " ") or None,
        label=label,
        compile="off",
        sdpa_backend="auto",
        batch=4,
        seq_len=seq_len,
        embed_dim=1024,
        num_heads=16,
        dtype="bfloat16",
        device="cuda",
        mask="none",
        mode="fwd",
        status="ok",
        timed_by="graph",
        latency_ms_median=device_ms,
        latency_ms_ci_low=device_ms * 0.99,
        latency_ms_ci_high=device_ms * 1.01,
        speedup=ref_device / device_ms,
        speedup_ci_low=ref_device / device_ms * 0.98,
        speedup_ci_high=ref_device / device_ms * 1.02,
        eager_ms_median=eager_ms,
        eager_ms_ci_low=eager_ms * 0.97,
        eager_ms_ci_high=eager_ms * 1.03,
        eager_speedup=ref_eager / eager_ms,
        eager_speedup_ci_low=ref_eager / eager_ms * 0.95,
        eager_speedup_ci_high=ref_eager / eager_ms * 1.05,
        sdpa_kernel="cudnn",
        peak_mem_mb=1.0,
        rerun_noise=0.01,
        noise_target_met=True,
    )
    row.update(keys)
    row["launch_bound"] = row["eager_ms_median"] >= schema.LAUNCH_BOUND * row["latency_ms_median"]
    return row


def rows():
    """Two shapes of four ways each. At L=1024 every way waits for Python (eager 0.2 ms a call,
    device 0.05-0.09 ms: device time names a winner, eager calls tie); at L=8192 the GPU sets the
    pace (eager within 2% of device)."""
    out = [
        gpu_row("reference", B_HOST, 0.10, 0.21),
        gpu_row("fused/attention=sdpa,merge=view", B_HOST, 0.05, 0.20),
        gpu_row("separate/attention=sdpa,merge=view", B_HOST, 0.09, 0.20),
        gpu_row("packed/attention=sdpa,merge=view", B_HOST, 0.07, 0.20),
    ]
    out += [
        gpu_row(label, B_GPU, ms, ms * 1.02)
        for label, ms in (
            ("reference", 0.8),
            ("fused/attention=sdpa,merge=view", 0.40),
            ("separate/attention=sdpa,merge=view", 0.44),
            ("packed/attention=sdpa,merge=view", 0.48),
        )
    ]
    ref = {
        L: next(r for r in out if r["variant"] == "reference" and r["seq_len"] == L)
        for L in (B_HOST, B_GPU)
    }
    for r in out:  # nn.MHA's own eager and device times at its shape
        base = ref[r["seq_len"]]
        r["speedup"] = base["latency_ms_median"] / r["latency_ms_median"]
        r["speedup_ci_low"], r["speedup_ci_high"] = r["speedup"] * 0.98, r["speedup"] * 1.02
        r["eager_speedup"] = base["eager_ms_median"] / r["eager_ms_median"]
        r["eager_speedup_ci_low"] = r["eager_speedup"] * 0.95
        r["eager_speedup_ci_high"] = r["eager_speedup"] * 1.05
    return out


def test_findings_say_each_shapes_regime_and_the_eager_comparison_where_it_differs():
    a = analyze(pd.DataFrame(rows()))
    said = {}
    for f in a.findings:
        said.setdefault(f["factor"], []).append(f["text"])
    # device time ranks: the fused way wins at both shapes
    assert a.ranked["winner"].tolist() == ["fused/attention=sdpa,merge=view"] * 2
    regime = said["regime"]
    assert len(regime) == 1, regime
    rule = f"eager call time at least {schema.LAUNCH_BOUND:g}x device time"
    assert rule in regime[0]
    assert regime[0].startswith(f"every way is launch-bound at B=4 L={B_HOST};"), regime
    assert f"the GPU sets the pace (no way launch-bound) at B=4 L={B_GPU}" in regime[0]
    # the launch-bound shape gets its eager sentence, with the eager figures a user acts on
    eager = said["eager"]
    assert len(eager) == 1, eager  # nothing for the GPU-bound shape: eager agrees there
    text = eager[0]
    assert text.startswith(f"every way at B=4 L={B_HOST} runs at Python's pace: 0.2 ms an eager")
    assert "(device time 0.05-0.1 ms ranks them)" in text
    # eager, the ways tie: how many, and the best's eager speedup with its interval
    assert (
        "by eager call time, 4 of 4 ways cannot be told apart, within the best's interval (" in text
    )
    best = text.split("by eager call time, ")[-1]
    assert "(fused/attention=sdpa,merge=view: 1.05x [1.00, 1.10] nn.MultiheadAttention's " in best
    # an interval, not a bare number


def test_a_gpu_bound_shape_whose_eager_ranking_differs_gets_its_own_sentence():
    """Device time ranks fused first; the eager calls (launches included) rank packed first,
    clear of it: the eager sentence says so, with both names."""
    out = [r for r in rows() if r["seq_len"] == B_GPU]
    for r in out:
        if r["label"].startswith("packed"):
            r.update(eager_ms_median=0.30, eager_ms_ci_low=0.29, eager_ms_ci_high=0.31)
            r["eager_speedup"] = 0.8 * 1.02 / 0.30
            r["eager_speedup_ci_low"] = r["eager_speedup"] * 0.98
            r["eager_speedup_ci_high"] = r["eager_speedup"] * 1.02
            r["launch_bound"] = False
    said = [f["text"] for f in analyze(pd.DataFrame(out)).findings if f["factor"] == "eager"]
    assert len(said) == 1, said
    assert "packed/attention=sdpa,merge=view is fastest" in said[0]
    assert "clear of every other way" in said[0]
    assert "where device time ranks fused/attention=sdpa,merge=view first" in said[0]


def test_cpu_rows_and_rows_without_eager_times_have_no_regime_finding():
    cpu = [
        {
            k: v
            for k, v in r.items()
            if not k.startswith("eager") and k not in ("timed_by", "launch_bound")
        }
        | {"device": "cpu"}
        for r in rows()
    ]
    said = {f["factor"] for f in analyze(pd.DataFrame(cpu)).findings}
    assert not said & {"regime", "eager"}, said


def test_a_way_not_captured_in_a_cuda_graph_is_counted():
    out = rows()
    out[2].update(timed_by="events", launch_bound=None, graph_error="capture failed: sync")
    out[2]["latency_ms_median"] = out[2]["eager_ms_median"]
    regime = [f["text"] for f in analyze(pd.DataFrame(out)).findings if f["factor"] == "regime"]
    assert "1 timed way could not be captured in a CUDA graph" in regime[0], regime
    assert f"3 of 4 ways at B=4 L={B_HOST}" in regime[0], regime


def test_the_report_note_states_the_rule_with_the_schemas_ratio():
    df = pd.DataFrame(rows())
    note = launch_bound_note(df)
    assert note.startswith("4 of 8 timed CUDA points are launch-bound"), note
    assert f"eager call time at least {schema.LAUNCH_BOUND:g}x device time" in note
    assert "launch_ms_per_call" not in note


# -- kernel swaps --------------------------------------------------------------------------------


def compile_rows():
    """Compile pairs at two shapes: SDPA compiled and eager run the same kernel (compile gains
    nothing); manual attention compiled runs cuDNN SDPA (Inductor's pattern), 3x faster: the
    kernel's doing."""
    out = []
    for L in (1024, 4096):
        for attention, mode, kernel, ms in (
            ("sdpa", "off", "cudnn", 0.10),
            ("sdpa", "default", "cudnn", 0.10),
            ("manual", "off", "none", 0.30),
            ("manual", "default", "cudnn", 0.10),
        ):
            r = gpu_row(
                f"fused/attention={attention},merge=view", L, ms * L / 1024, ms * L / 1024 * 1.1
            )
            r.update(compile=mode, sdpa_kernel=kernel)
            out.append(r)
        out.append(gpu_row("reference", L, 0.2 * L / 1024, 0.22 * L / 1024, sdpa_kernel="cudnn"))
    return out


def test_a_compile_pair_whose_kernel_changed_is_labelled_kept_apart_and_said():
    a = analyze(pd.DataFrame(compile_rows()))
    pairs = a.effects[a.effects["factor"] == "compile"]
    swapped = pairs[pairs["context"].str.contains("attention=manual")]
    same = pairs[pairs["context"].str.contains("attention=sdpa")]
    assert swapped["kernel_change"].tolist() == ["none->cudnn"] * 2
    assert same["kernel_change"].tolist() == ["", ""]
    assert swapped["baseline_kernel"].tolist() == ["none"] * 2
    assert swapped["alternative_kernel"].tolist() == ["cudnn"] * 2
    # the attention factor chooses the kernel itself: a kernel change there is the effect
    attention = a.effects[a.effects["factor"] == "attention"]
    assert len(attention) and set(attention["kernel_change"]) == {""}
    # summed up apart: the compile effect with the same kernel is a tie, the swap 3x
    top = a.summary[(a.summary["factor"] == "compile") & (a.summary["by"] == "all")]
    by_change = top.set_index("kernel_change")
    assert set(by_change.index) == {"", "none->cudnn"}
    assert by_change.loc["", "verdict"] == "tie" and by_change.loc["", "n"] == 2
    assert abs(by_change.loc["none->cudnn", "ratio"] - 3) < 0.01
    said = [f["text"] for f in a.findings if f["factor"] == "compile"]
    assert len(said) == 1, said
    text = said[0]
    assert "over 2 pairs that ran the same kernel" in text
    assert "Inductor swapped the kernel in 2 more pairs (no SDPA kernel -> cuDNN SDPA" in text
    assert "attention=manual (2)" in text
    assert "3.00x" in text and "which compares kernels, not torch.compile alone" in text
    assert "it depends on attention" not in text  # the swap no longer reads as compile's effect


def test_when_every_compile_pair_swapped_the_finding_says_so():
    only = [r for r in compile_rows() if "manual" in r["label"] or r["variant"] == "reference"]
    only = [r for r in only if r["variant"] != "reference"]
    a = analyze(pd.DataFrame(only))
    text = [f["text"] for f in a.findings if f["factor"] == "compile"][0]
    assert text.startswith("torch.compile is 3.00x"), text
    assert "but Inductor swapped the kernel in every pair (no SDPA kernel -> cuDNN SDPA" in text


def test_an_effects_csv_from_before_the_kernel_columns_still_summarizes():
    a = analyze(pd.DataFrame(compile_rows()))
    old = a.effects.drop(columns=["kernel_change", "baseline_kernel", "alternative_kernel"])
    summary = effects.summarize(old)
    assert set(summary["kernel_change"]) == {""}
    assert findings.findings(summary)  # said as before: one compile effect


def test_effects_carry_the_eager_ratio_and_say_it_where_it_differs():
    """Device time: fused 1.8x faster than separate; eager (both wait for Python): a tie. The
    structure finding gives the eager answer its own clause with its interval."""
    a = analyze(pd.DataFrame([r for r in rows() if r["seq_len"] == B_HOST]))
    pair = a.effects[
        (a.effects["factor"] == "structure")
        & (a.effects["baseline"] == "separate")
        & (a.effects["alternative"] == "fused")
    ].iloc[0]
    assert abs(pair["ratio"] - 1.8) < 0.01 and pair["verdict"] == "faster"
    assert abs(pair["eager_ratio"] - 1.0) < 0.01
    assert pair["eager_ratio_ci_low"] < 1 < pair["eager_ratio_ci_high"]
    assert not math.isnan(pair["baseline_eager_ms"])
    said = [f["text"] for f in a.findings if f["factor"] == "structure"]
    text = next(t for t in said if t.startswith("one fused QKV projection is 1.80x"))
    assert (
        "in eager call time (launches included, what a Python caller waits) they cannot be "
        "told apart: 1.00x [" in text
    )


def test_the_report_shows_the_regimes_eager_times_and_kernel_swaps(tmp_path):
    """The whole page from hand-built GPU rows (strict: a figure that fails raises): the note in
    the rule's words, the eager figures, the best way's eager time with its interval, the
    effects' eager column and the kernel swap's own line."""
    from harness.report import render

    df = pd.DataFrame(rows() + [r for r in compile_rows() if r["seq_len"] == 4096])
    html = render.render(df, tmp_path, [tmp_path], strict=True)[0]
    assert f"eager call time at least {schema.LAUNCH_BOUND:g}x device time" in html
    assert 'data-figure="eager_latency"' in html and 'data-figure="eager_over_device"' in html
    assert 'id="regime"' in html and "eager ms [95%]" in html and "eager [95%]" in html
    assert "kernel none-&gt;cudnn" in html
    findings = html[html.index('id="findings"') : html.index("</ul>", html.index('id="findings"'))]
    assert "<b>regime</b>" in findings and "<b>eager</b>" in findings
    assert 'href="#regime"' in findings


@pytest.mark.slow
def test_the_row_names_the_kernel_that_ran_under_compile():
    """The probe profiles the compiled call, not the eager one: on this CPU Inductor's pattern
    matcher turns compiled manual attention into SDPA's CPU flash kernel (on CUDA: cuDNN or
    flash), and the row says so, where its eager twin ran no SDPA kernel (a compile: slow)."""
    from harness import time_it

    quick = {"rounds": 2, "warmup": 0.001, "round_time": 0.001}
    kernels = {
        mode: time_it(
            "fused",
            variant={"attention": "manual"},
            compile=mode,
            seq_len=16,
            batch=1,
            embed_dim=32,
            num_heads=4,
            num_threads=1,
            timing=quick,
        )["sdpa_kernel"]
        for mode in ("off", "default")
    }
    assert kernels == {"off": "none", "default": "cpu_flash"}, kernels
