"""mha-bench: check, time and report ways of writing multi-head attention (README).

The Python API (harness/api.py): ``verify``, ``assert_matches``, ``time_it`` and
``make_point``. They are imported on first use, so that ``import harness`` (the command line)
stays light. (Not ``check`` nor ``point``: those are the stages harness/way/ and
harness/point/.)
"""

API = ("verify", "assert_matches", "time_it", "make_point")
__all__ = list(API)


def __getattr__(name: str):
    if name in API:
        from harness import api

        return getattr(api, name)
    raise AttributeError(f"module 'harness' has no attribute {name!r}")
