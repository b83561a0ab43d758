"""``python -m harness [overrides]``: one point, or a sweep with -m; the same as ``mha-bench run``
(harness/cli.py, then Hydra in harness/sweep/run.py)."""

import sys

if __name__ == "__main__":
    from harness.cli import run
    from harness.leaving import leave

    leave(run, sys.argv[1:])
