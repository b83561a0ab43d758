"""mha-bench harness: check, time and report multi-head attention variants (see README)."""
