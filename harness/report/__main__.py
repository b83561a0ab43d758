"""``python -m harness.report DIR``: (re)render the HTML report of a run or sweep dir."""

import sys

from harness.report.render import main

sys.exit(main())
