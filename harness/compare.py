"""``python -m harness.compare A B``: an alias of ``mha-bench compare``
(harness/report/compare.py)."""

import sys

from harness.report.compare import main

if __name__ == "__main__":
    sys.exit(main())
