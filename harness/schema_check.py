"""The result row's columns of the check against nn.MultiheadAttention (docs/methodology.md,
"How a point is checked"), in the CSV's order: part of harness/schema.py's ``ROW``."""

from __future__ import annotations

from harness.column import Column

CHECK = [
    Column("check_passed", "bool", "every compared tensor within its tolerance", table=True),
    Column(
        "max_abs_err",
        "tensor units",
        "worst tensor: max abs difference from the float64 oracle (inf: NaN/Inf where the "
        "oracle is finite, wrong shape, or missing)",
        table=True,
    ),
    Column(
        "max_rel_err",
        "ratio",
        "worst tensor: `max_abs_err / max(abs(oracle))` (normwise; elementwise ratios blow up"
        " near zero)",
    ),
    Column(
        "ref_err",
        "tensor units",
        "worst tensor: nn.MHA's own max abs error in this dtype against the oracle",
    ),
    Column(
        "err_ratio",
        "ratio",
        "`max_abs_err / ref_err`: how many times nn.MHA's own error",
        table=True,
    ),
    Column(
        "tolerance",
        "tensor units",
        "worst tensor: `max(ATOL[dtype] * max(1, max(abs(oracle))), K * ref_err)`, K = 4 (16 at "
        "activation scale)",
        table=True,
    ),
    Column(
        "worst_tensor",
        "name",
        "the tensor with the largest error relative to its tolerance: `out`, `attn_weights`, "
        "`grad_query`, `grad_key`, `grad_value`, `grad_in_proj_weight`, ...; at a decode point "
        "`step2_out` is the second step, on the cache the first one wrote",
        table=True,
    ),
    Column(
        "failed_tensors",
        "names",
        "every tensor over its tolerance, `;`-joined, forward tensors first "
        "(`out;grad_query;grad_in_proj_bias`); empty when all pass",
        table=True,
    ),
    Column("worst_index", "index", "where in that tensor the largest error is, e.g. `(0, 5, 17)`"),
    Column("tensors_checked", "count", "how many tensors were compared"),
    Column(
        "checked_rows",
        "count",
        "the query rows whose output and attention weights were compared with the float64 "
        "oracle: `all`, or how many of a sample (`check_sample_rows`; above seq_len 1024 by "
        "default); gradients are compared whole and exactly either way "
        "(docs/methodology.md, Checks at long sequences)",
    ),
    Column(
        "fp32_check",
        "text",
        "float16/bfloat16 points: the structure check, the module in float32 at the same shape "
        "against the same oracle (`ok`, `mismatch`, or `unsupported: why` where its kernel runs "
        "no float32, `oom: ...` where it did not fit); empty for float32 points",
    ),
    Column("fp32_check_s", "s", "wall time of that float32 check (part of `check_s`)"),
    Column(
        "act_check",
        "text",
        "the activation-scale check: the point's inputs with a few outlier channels scaled up "
        "until nn.MHA's largest attention logit is `check_max_logit` (`ok`, `mismatch`, `off`, "
        "`status: why` where the call failed there, `not run: why` where no factor reaches it; "
        "`(nn.MHA itself non-finite ...)` names elements nn.MHA overflows in, not compared); "
        "empty when the unit-scale check failed",
    ),
    Column(
        "act_max_logit",
        "logit",
        "largest q . k / sqrt(head_dim) nn.MHA computes at activation scale (over every query "
        "row the check compares, or 2^22 logits spread evenly over them at long sequences)",
    ),
    Column(
        "act_scale",
        "ratio",
        "what the outlier channels were multiplied by to reach it (1: the point's own logits "
        "already did)",
    ),
    Column(
        "act_err_ratio",
        "ratio",
        "at activation scale, the worst tensor's error as a multiple of nn.MHA's own there "
        "(`err_ratio` of that check)",
    ),
    Column("act_check_s", "s", "wall time of the activation-scale check (part of `check_s`)"),
    Column(
        "failed_scale",
        "text",
        "a mismatch: the inputs it showed at, `unit` (the point's own, standard-normal: its "
        "dtype or the float32 structure check) or `activation` (the check columns above then "
        "describe the activation-scale check); empty otherwise",
        table=True,
    ),
    Column(
        "diagnosis",
        "names",
        "a mismatch: the known mistakes (docs/reference.md, Known mistakes) whose float64 math "
        "every compared tensor matches within its tolerance, `;`-joined (`heads_merged_without_"
        "permute`); `none` when no mistake that shows at the point matches; `not run: why` above "
        "the size the catalogue runs at; empty on a point that passed",
        table=True,
    ),
    Column("diagnosis_tried", "count", "the known mistakes computed that show at the point"),
    Column(
        "wrong_in",
        "text",
        "a mismatch: what is wrong, `forward` (the output or attention weights), `second_step` "
        "(a decode point's second step only, on the cache the first wrote) or `gradients` (the "
        "forward matches)",
    ),
    Column(
        "wrong_heads",
        "index ranges",
        "the heads whose block of the output, mapped back through nn.MHA's output projection, "
        "differs (`1, 3`; `0-7`)",
    ),
    Column("wrong_rows", "index ranges", "the query rows whose output differs"),
    Column("wrong_batch", "index ranges", "the batch elements whose output differs"),
    Column(
        "wrong_keys",
        "index ranges",
        "the key positions whose attention weights (or, cross-attention, key and value "
        "gradients) differ; empty where the point has neither",
    ),
    Column(
        "wrong_where",
        "text",
        "the sentence of those columns, as the row's error ends: `Where: the output differs in "
        "all 4 heads, query rows 5-7 of 8, ...`",
    ),
    Column("diagnose_s", "s", "wall time of the diagnosis and localisation (part of `check_s`)"),
    Column(
        "check_s",
        "s",
        "wall time of the check: the float64 oracle (or its share, reused by the shape's other "
        "ways), nn.MHA in the point's dtype, the variant's first call and the comparison",
    ),
]
