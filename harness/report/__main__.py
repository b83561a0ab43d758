"""``python -m harness.report DIR``: (re)render the HTML report of a run or sweep dir."""

from harness.leaving import leave
from harness.report.render import main

leave(main)
