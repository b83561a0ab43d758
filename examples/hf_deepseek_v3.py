"""transformers' DeepseekV3Attention: multi-head latent attention (DeepSeek-V3, Kimi K2) with its
own latent norms, kv_b_proj per head [k_nope; v], its [nope; rope] heads and interleaved rotary
embeddings (``rope_interleave``) over the rope channels; no biases. Run it at kv_lora_rank > 0."""

import torch

from variants.adapters import DecoderAttention, library_attention, library_rope

DEEPSEEK = "transformers.models.deepseek_v3.modeling_deepseek_v3"


class DeepseekV3MHA(DecoderAttention):
    _fixed_ = {"bias": False}  # attention_bias=False in DeepSeek-V3

    def __init__(self, embed_dim, num_heads, bias=False, latent=None, rotary=None,
                 attn_implementation="eager"):  # fmt: skip
        if latent is None:
            raise NotImplementedError("DeepseekV3Attention is latent attention: kv_lora_rank > 0")
        D, rope = embed_dim // num_heads, latent["rope"]
        # its rotary module turns qk_rope_head_dim channels: the whole of what it is handed
        whole = None if rotary is None else {**rotary, "fraction": 1.0}
        attn, config = library_attention(
            DEEPSEEK, "DeepseekV3", whole, hidden_size=embed_dim, num_attention_heads=num_heads,
            num_key_value_heads=num_heads, q_lora_rank=latent["q_rank"] or None,
            kv_lora_rank=latent["kv_rank"], qk_rope_head_dim=rope, qk_nope_head_dim=D - rope,
            v_head_dim=latent["value"], rms_norm_eps=latent["eps"],
            rope_interleave=rotary is None or rotary["layout"] == "interleaved",
            attn_implementation=attn_implementation,
        )  # fmt: skip
        self.latent = latent
        super().__init__(attn, config, (False, False), head_dim=rope,
                         rope=library_rope(DEEPSEEK, "DeepseekV3", config, whole))  # fmt: skip

    def map_weights(self, state_dict: dict, prefix: str) -> None:
        """The oracle's factors (harness/features/latent.py) into DeepSeek's layout: per head
        [nope; rope] query rows, kv_a_proj_with_mqa [kv_down; k_rope], kv_b_proj per head
        [k_nope; v], o_proj without the values' padding."""
        s, H, E = self.latent, self.num_heads, self.config.hidden_size
        D, rope, r = E // H, s["rope"], s["kv_rank"]
        take = lambda name: state_dict.pop(prefix + name)  # noqa: E731
        into = prefix + "attn."
        w = take("in_proj_weight")
        state_dict.pop(prefix + "in_proj_bias", None)
        q = take("q_up") if s["q_rank"] else w[:E]
        q = q.view(H, D, -1)  # per head [rope; nope] -> DeepSeek's [nope; rope]
        q = torch.cat([q[:, rope:], q[:, :rope]], 1).flatten(0, 1)
        if s["q_rank"]:
            state_dict[into + "q_b_proj.weight"] = q
            state_dict[into + "q_a_proj.weight"] = take("q_down")
            state_dict[into + "q_a_layernorm.weight"] = take("q_down_norm")
        else:
            state_dict[into + "q_proj.weight"] = q
        kv_a = torch.cat([take("kv_down"), take("k_rope")])  # (r + rope, E)
        state_dict[into + "kv_a_proj_with_mqa.weight"] = kv_a
        state_dict[into + "kv_a_layernorm.weight"] = take("kv_down_norm")
        k_up, v_up = take("k_up").view(H, D - rope, r), take("v_up").view(H, s["value"], r)
        state_dict[into + "kv_b_proj.weight"] = torch.cat([k_up, v_up], 1).flatten(0, 1)
        o = take("out_proj.weight").view(E, H, D)[:, :, : s["value"]]
        state_dict[into + "o_proj.weight"] = o.reshape(E, -1)
        state_dict.pop(prefix + "out_proj.bias", None)
