"""Adapters that put other libraries' attention modules on mha-bench's variant contract.

Run them from the repository root with ``--config-dir examples/conf`` (examples/README.md).
"""
