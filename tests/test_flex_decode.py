"""attention=flex decodes right at every step: inductor's CPU FlexAttention kernel with 8-float
vectors (AVX2) got every key count of 8 (mod 16) wrong, so the second decode step (P + 2L keys:
24, 72) was a mismatch on such CPUs (variants/kernels/flex.py, CPU_KEY_MULTIPLE;
docs/architecture.md, Known traps). The kernel is compiled here for 8-float vectors whatever this
CPU has (an AVX-512 CPU runs AVX2 code too), so the test sees the bug on any x86 machine.

Each query length, padded key length and dtype is a kernel compiled (15-20 s on 2 cores with
inductor's cache cold): make test checks the failing steps (L=4: 3 kernels), make test-slow the
issue's whole grid (12 kernels, about 200 s cold, 25 s warm). The structures and cache styles
share them."""

import contextlib
import itertools

import pytest

from harness.api import verify

CASE = dict(embed_dim=64, num_heads=4, batch=2, device="cpu", num_threads=1)
STRUCTURES = ("separate", "fused", "packed")


@contextlib.contextmanager
def avx2_code():
    """Inductor's CPU kernels compiled for 256-bit vectors (8 floats), graphs made afresh before
    and after (Dynamo's guards do not see inductor's settings)."""
    import torch._dynamo
    import torch._inductor.config as inductor

    isa = torch.backends.cpu.get_cpu_capability()
    if isa not in ("AVX2", "AVX512"):
        pytest.skip(f"needs an x86 CPU with AVX2 (this one: {isa})")
    torch._dynamo.reset()
    try:
        with inductor.patch({"cpp.simdlen": 256}):
            yield
    finally:
        torch._dynamo.reset()


def decode_grid(cases) -> list[str]:
    """Every structure and cache style at each (dtype, L, P): what is not ok."""
    wrong = []
    with avx2_code():
        for dtype, L, P in cases:
            for structure, style in itertools.product(STRUCTURES, ("static", "concat")):
                row = verify(
                    structure,
                    variant={"attention": "flex"},
                    seq_len=L,
                    kv_cache_len=P,
                    kv_cache=style,
                    dtype=dtype,
                    **CASE,
                )
                if row["status"] != "ok":
                    wrong.append(f"{structure} {style} L={L} P={P} {dtype}: {row['error']}")
    return wrong


@pytest.mark.slow  # inductor compiles each case (70 s in a fresh venv): make test-slow and CI
def test_flex_decodes_the_second_step_right_where_it_failed():
    """The filed cases: L=4 at P=16 and 64 (second steps of 24 and 72 keys), one dtype each (the
    whole grid, every dtype: the slow test below)."""
    wrong = decode_grid([("float32", 4, 16), ("bfloat16", 4, 64)])
    assert not wrong, "\n".join(wrong)


@pytest.mark.slow
def test_flex_decodes_both_steps_right_for_every_structure_cache_length_and_dtype():
    cases = itertools.product(("float32", "bfloat16"), (1, 2, 4), (16, 64))
    wrong = decode_grid(cases)
    assert not wrong, "\n".join(wrong)


def test_without_the_key_padding_the_second_step_is_wrong_on_8_float_vectors(monkeypatch):
    """The control: the same check, the padding turned off, sees torch's bug (S = 16 + 2 x 4 =
    24 keys at the second step), so the test above would see it come back."""
    from variants.kernels import flex

    monkeypatch.setattr(flex, "CPU_KEY_MULTIPLE", 1)
    with avx2_code():
        row = verify("fused", variant={"attention": "flex"}, seq_len=4, kv_cache_len=16, **CASE)
    assert row["status"] == "mismatch" and row["worst_tensor"] == "step2_out", row["error"]
    assert row["failed_scale"] == "unit"
