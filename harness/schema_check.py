"""The result record's parts of the check against nn.MultiheadAttention (docs/methodology.md,
"How a point is checked"): each field a column of results.csv, its unit and meaning declared with
it (``col``); harness/schema.py puts the parts in the CSV's order."""

from __future__ import annotations

from dataclasses import dataclass

from harness.column import Part, col


@dataclass(frozen=True)
class Check(Part):
    """What the check found (harness/way/check.py): the memory it expected, what the first call
    compiled, the worst tensor against its tolerance, the checks at activation scale and in
    float32, and which scale failed."""

    mem_estimate_mb: float | None = col(
        "MiB",
        "lower bound of what the point holds on its device during the check (inputs, weights,"
        " activations, the L x S scores where the path materialises them, x3 in `fwd_bwd`), "
        "checked against free memory before anything is built",
    )
    compile_s: float | None = col(
        "s",
        "first call of the compiled variant, compilation included (empty when nothing was "
        "compiled)",
        table=True,
    )
    compiled_graphs: int | None = col("count", "graphs compiled for the point")
    cuda_graphs: bool | None = col(
        "bool",
        "compile=reduce-overhead or max-autotune: whether the timed call replays CUDA graphs; "
        "false on the CPU and where inductor skipped them (it does so for an input mutated in "
        "place, such as a KV cache written at decode, saying so only in a log line); empty for "
        "other compile modes",
    )
    compiled_shapes: str | None = col(
        "name",
        "`compile` on: `static` when the graph timed was compiled for the point's own shapes "
        "(always, unless a variant asks otherwise), `dynamic` when it takes symbolic sizes; read "
        "from Dynamo's guards, empty where this torch does not say",
        table=True,
    )
    check_passed: bool | None = col(
        "bool", "every compared tensor within its tolerance", table=True
    )
    max_abs_err: float | None = col(
        "tensor units",
        "worst tensor: max abs difference from the float64 oracle (inf: NaN/Inf where the "
        "oracle is finite, wrong shape, or missing)",
        table=True,
    )
    max_rel_err: float | None = col(
        "ratio",
        "worst tensor: `max_abs_err / max(abs(oracle))` (normwise; elementwise ratios blow up"
        " near zero)",
    )
    ref_err: float | None = col(
        "tensor units", "worst tensor: nn.MHA's own max abs error in this dtype against the oracle"
    )
    err_ratio: float | None = col(
        "ratio", "`max_abs_err / ref_err`: how many times nn.MHA's own error", table=True
    )
    tolerance: float | None = col(
        "tensor units",
        "worst tensor: `max(ATOL[dtype] * max(1, max(abs(oracle))), K * ref_err)`, K = 4 (16 at "
        "activation scale)",
        table=True,
    )
    worst_tensor: str | None = col(
        "name",
        "the tensor with the largest error relative to its tolerance: `out`, `attn_weights`, "
        "`grad_query`, `grad_key`, `grad_value`, `grad_in_proj_weight`, ...; at a decode point "
        "`step2_out` is the second step, on the cache the first one wrote",
        table=True,
    )
    failed_tensors: str | None = col(
        "names",
        "every tensor over its tolerance, `;`-joined, forward tensors first "
        "(`out;grad_query;grad_in_proj_bias`); empty when all pass",
        table=True,
    )
    worst_index: str | None = col(
        "index", "where in that tensor the largest error is, e.g. `(0, 5, 17)`"
    )
    tensors_checked: int | None = col("count", "how many tensors were compared")
    checked_rows: int | None = col(
        "count",
        "the query rows whose output and attention weights were compared with the float64 "
        "oracle: `all`, or how many of a sample (`check_sample_rows`; above seq_len 1024 by "
        "default); gradients are compared whole and exactly either way "
        "(docs/methodology.md, Checks at long sequences)",
    )
    fp32_check: str | None = col(
        "text",
        "float16/bfloat16 points: the structure check, the module in float32 at the same shape "
        "against the same oracle (`ok`, `mismatch`, or `unsupported: why` where its kernel runs "
        "no float32, `oom: ...` where it did not fit); empty for float32 points",
    )
    fp32_check_s: float | None = col("s", "wall time of that float32 check (part of `check_s`)")
    act_check: str | None = col(
        "text",
        "the activation-scale check: the point's inputs with a few outlier channels scaled up "
        "until nn.MHA's largest attention logit is `check_max_logit` (`ok`, `mismatch`, `off`, "
        "`status: why` where the call failed there, `not run: why` where no factor reaches it; "
        "`(nn.MHA itself non-finite ...)` names elements nn.MHA overflows in, not compared); "
        "empty when the unit-scale check failed",
    )
    act_max_logit: float | None = col(
        "logit",
        "largest q . k / sqrt(head_dim) nn.MHA computes at activation scale (over every query "
        "row the check compares, or 2^22 logits spread evenly over them at long sequences)",
    )
    act_scale: float | None = col(
        "ratio",
        "what the outlier channels were multiplied by to reach it (1: the point's own logits "
        "already did)",
    )
    act_err_ratio: float | None = col(
        "ratio",
        "at activation scale, the worst tensor's error as a multiple of nn.MHA's own there "
        "(`err_ratio` of that check)",
    )
    act_check_s: float | None = col(
        "s", "wall time of the activation-scale check (part of `check_s`)"
    )
    failed_scale: str | None = col(
        "text",
        "a mismatch: the inputs it showed at, `unit` (the point's own, standard-normal: its "
        "dtype or the float32 structure check) or `activation` (the check columns above then "
        "describe the activation-scale check); empty otherwise",
        table=True,
    )
    check_s: float | None = col(
        "s",
        "wall time of the check: the float64 oracle (or its share, reused by the shape's other "
        "ways), nn.MHA in the point's dtype, the variant's first call and the comparison",
    )


@dataclass(frozen=True)
class Diagnosis(Part):
    """On a mismatch, which known mistake the module computes and where its error is
    (harness/way/diagnose.py)."""

    diagnosis: str | None = col(
        "names",
        "a mismatch: the known mistakes (docs/reference.md, Known mistakes) whose float64 math "
        "every compared tensor matches within its tolerance, `;`-joined (`heads_merged_without_"
        "permute`); `none` when no mistake that shows at the point matches; `not run: why` above "
        "the size the catalogue runs at; empty on a point that passed",
        table=True,
    )
    diagnosis_tried: int | None = col("count", "the known mistakes computed that show at the point")
    diagnosis_says: str | None = col(
        "text",
        "the diagnosis in words: what the module computes (`it computes nn.MHA with the heads "
        "merged without the permute ...`), or that no known mistake matches",
    )
    diagnosis_fix: str | None = col(
        "text",
        "the fix of each matched mistake, `; or `-joined (`o.transpose(1, 2).reshape(B, L, E): "
        "...`); empty when none matches",
    )
    wrong_in: str | None = col(
        "text",
        "a mismatch: what is wrong, `forward` (the output or attention weights), `second_step` "
        "(a decode point's second step only, on the cache the first wrote) or `gradients` (the "
        "forward matches)",
    )
    wrong_heads: str | None = col(
        "index ranges",
        "the heads whose block of the output, mapped back through nn.MHA's output projection, "
        "differs (`1, 3`; `0-7`)",
    )
    wrong_rows: str | None = col("index ranges", "the query rows whose output differs")
    wrong_batch: str | None = col("index ranges", "the batch elements whose output differs")
    wrong_keys: str | None = col(
        "index ranges",
        "the key positions whose attention weights (or, cross-attention, key and value "
        "gradients) differ; empty where the point has neither",
    )
    wrong_where: str | None = col(
        "text",
        "the sentence of those columns, as the row's error ends: `Where: the output differs in "
        "all 4 heads, query rows 5-7 of 8, ...`",
    )
    diagnose_s: float | None = col(
        "s", "wall time of the diagnosis and localisation (part of `check_s`)"
    )

