"""``python -m harness.tensorboard DIR``: an alias of ``mha-bench tensorboard``
(harness/report/tensorboard.py)."""

import sys

from harness.report.tensorboard import main

if __name__ == "__main__":
    sys.exit(main())
