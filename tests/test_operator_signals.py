"""Issue 58's operator gallery, its stops: a closed pipe, SIGINT, SIGTERM, SIGHUP and SIGKILL
at each moment of a sweep (tests/operator/gallery.py says what each case asserts)."""

import pytest

from tests.operator.gallery import case, cases


STOPS = ("pipe", "SIGINT", "SIGTERM", "SIGHUP", "SIGKILL")


# and while Hydra composes the next job, where its own cleanup hides the stop under its error
@pytest.mark.parametrize(
    "action, moment", cases(STOPS) + cases(("SIGINT", "SIGTERM", "SIGHUP"), ("composing",))
)
def test_a_stop_at_any_moment_is_one_line_and_resume_loses_nothing(tmp_path, action, moment):
    case(tmp_path, action, moment)
