"""Ways of writing multi-head attention, each a drop-in for nn.MultiheadAttention(batch_first=True).

The variant contract (docs/adding.md, "Adding a variant" says the same):

* An ``nn.Module`` class importable by dotted path, registered by one Hydra config
  ``conf/variant/<name>.yaml`` whose ``_target_`` names the class. The config group is the
  registry: a new variant is one ``.py`` and one ``.yaml``, nothing else to edit.
* Built as ``cls(embed_dim=E, num_heads=H, bias=True|False, **options)``; the yaml's other keys
  are the options (e.g. ``attention: manual|sdpa|flex``, ``merge: view|reshape``). Bad options raise
  ``ValueError`` naming the value (the harness records the point as ``invalid``); a case the
  module cannot do raises ``NotImplementedError`` (``unsupported``).
* What it can do may be declared, in the yaml or as class attributes of the same names:
  ``_supports_ = {"mask": ["none", "causal"], "cross": False, "reason": "..."}`` (other values
  are ``unsupported`` before the module is built) and ``_fixed_ = {"bias": False}`` (the value
  every point runs with; the row's ``fixed`` column says what was asked).
* ``forward(query, key, value, key_padding_mask=None, need_weights=False, attn_mask=None,
  average_attn_weights=True, is_causal=False) -> (out, attn_weights | None)``, batch first:
  query (B, L, E), key/value (B, S, E), out (B, L, E); weights (B, L, S) averaged over heads,
  or (B, H, L, S) with ``average_attn_weights=False``. Masks follow nn.MultiheadAttention: bool
  True means "may not attend", float masks are added to the scores.
* ``load_state_dict(nn.MultiheadAttention(E, H, bias=..., batch_first=True).state_dict())``
  works: keys ``in_proj_weight`` (3E, E) rows [Wq; Wk; Wv], ``in_proj_bias`` (3E,),
  ``out_proj.weight`` (E, E), ``out_proj.bias`` (E,). A variant that stores weights
  differently maps them in a load pre-hook (see ``separate.py`` and ``packed.py``), using
  plain tensor ops (chunk, split, reshape, permute, cat): the checker runs the hook on tensors
  that require grad to map the variant's parameter gradients back to nn.MHA's names.
  A persistent buffer is a key strict loading expects: insert it in the hook, or register it
  with ``persistent=False``.
* Optional (docs/adding.md, "Grouped heads, a KV cache, a window"): a ``num_kv_heads``
  argument (grouped-query attention: nn.MHA's K/V heads repeat per group, query head h using
  K/V head h // G); ``new_cache``, ``fill_cache`` and ``forward(..., kv_cache=None)`` for decode
  steps (variants/cache.py; a cache whose ``update`` commits has a ``rewind``: docs/adding.md,
  "The KV cache contract"). A sliding window arrives as an ``attn_mask``; a constructor that
  names ``window`` or ``kv_cache_len`` is given them. A library's decoder attention: the public
  helpers of ``variants/adapters.py``.
* ``torch.compile`` is applied by the harness (``compile=...``); it is not a variant.

Vocabulary in shape comments: B batch, L query length, S key length, E embed_dim, H heads,
Hkv K/V heads, P cached tokens, D = E // H head_dim.
"""
