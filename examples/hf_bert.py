"""transformers' BertSelfAttention (separate query/key/value Linears) with BertSelfOutput's dense
as out_proj."""

import torch.nn as nn

from variants.masks import merge_masks  # nn.MHA's masks as one additive float mask


def bert_classes() -> tuple[type, type, type]:
    """transformers' classes, imported when a point is built: where transformers does not import,
    each point is `unsupported` with the reason (an unmatched torchvision breaks it too)."""
    try:
        from transformers import BertConfig
        from transformers.models.bert.modeling_bert import BertSelfAttention, BertSelfOutput
    except Exception as e:
        raise NotImplementedError(
            f"transformers does not import here ({type(e).__name__}: {e}); see docs/guide.md, "
            "'Outside variants and checking a library's attention'"
        ) from e
    return BertConfig, BertSelfAttention, BertSelfOutput


ATTN_IMPLEMENTATIONS = ("eager", "sdpa")


class BertSelfAttentionMHA(nn.Module):
    """BertSelfOutput's dropout, residual and LayerNorm are left out: they are BERT's block, not
    MHA."""

    _supports_ = {
        "cross": False,
        "bias": True,
        "reason": "BERT's projections always have biases, and BertSelfAttention attends the hidden "
        "states to themselves (cross-attention is BertCrossAttention's, key and value one tensor)",
    }

    def __init__(
        self, embed_dim: int, num_heads: int, bias: bool = True, attn_implementation: str = "sdpa"
    ):
        super().__init__()
        # BertConfig takes any name and BERT only fails at its first forward: refuse it here.
        if attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ValueError(
                f"attn_implementation={attn_implementation!r} is not one of "
                f"{'|'.join(ATTN_IMPLEMENTATIONS)}"
            )
        if not bias:
            raise NotImplementedError("bias=False: BERT's projections always have biases")
        BertConfig, BertSelfAttention, BertSelfOutput = bert_classes()
        config = BertConfig(
            hidden_size=embed_dim,
            num_attention_heads=num_heads,
            attention_probs_dropout_prob=0.0,
            hidden_dropout_prob=0.0,
            attn_implementation=attn_implementation,
        )
        self.attn = BertSelfAttention(config)
        # nn.Linear(E, E): nn.MHA's out_proj keys as they are
        self.out_proj = BertSelfOutput(config).dense
        self.num_heads, self.attn_implementation = num_heads, attn_implementation
        self._register_load_state_dict_pre_hook(self.load_hook)

    def load_hook(self, state_dict, prefix, *args):
        if prefix + "in_proj_weight" not in state_dict:
            return
        # (3E, E) -> 3 x (E, E): Wq, Wk, Wv
        weights = state_dict.pop(prefix + "in_proj_weight").chunk(3)
        biases = state_dict.pop(prefix + "in_proj_bias").chunk(3)  # (3E,) -> 3 x (E,)
        for name, w, b in zip(("query", "key", "value"), weights, biases):
            state_dict[f"{prefix}attn.{name}.weight"], state_dict[f"{prefix}attn.{name}.bias"] = (
                w,
                b,
            )

    def forward(
        self,
        query,
        key,
        value,
        key_padding_mask=None,
        need_weights=False,
        attn_mask=None,
        average_attn_weights=True,
        is_causal=False,
    ):
        if not (query is key and key is value):
            raise NotImplementedError(
                "cross-attention: BertSelfAttention attends the hidden states to themselves "
                "(key and value must be the query tensor)"
            )
        sdpa = self.attn_implementation == "sdpa"
        if need_weights and sdpa:
            raise NotImplementedError(
                "need_weights=True: BERT's sdpa attention returns no weights "
                "(variant.attn_implementation=eager does)"
            )
        if is_causal and key_padding_mask is None and sdpa:
            # The hint as SDPA's own flag; eager ignores an is_causal keyword silently, so it gets
            # the mask below.
            out, weights = self.attn(query, is_causal=True)  # (B, L, E), None
        else:
            # BERT's kernels add a 4D mask to the scores; eager adds a bool one too (True as +1.0):
            # pass additive.
            B, L, _ = query.shape
            # (B|1, 1|H, L, L)
            mask = merge_masks(attn_mask, key_padding_mask, B, self.num_heads, L, L, query.dtype)
            out, weights = self.attn(query, attention_mask=mask)  # (B, L, E), eager: (B, H, L, L)
        if need_weights and average_attn_weights:
            weights = weights.mean(dim=1)  # (B, H, L, L) -> (B, L, L), as nn.MHA averages
        return self.out_proj(out), (weights if need_weights else None)  # (B, L, E)
