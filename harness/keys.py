"""How a config key is declared: ``key(default, help, role, choices)``, and the roles a
top-level key plays in a row (``ROLES``). Ground module: the vocabulary harness/config.py and
harness/config_measure.py declare their keys with."""

from __future__ import annotations

from dataclasses import field

from harness.validate import choice_text

# What a top-level key is to a row, declared once with the key (``key(role=...)``); every list
# of keys elsewhere (results' WAY_KEYS and SHAPE_KEYS, compare's match, the sweeper's grouping,
# the rounds' shape key, the config hash) is derived from it (docs/architecture.md, "One place
# per key"):
#   shape    defines the point's shape and case: two ways are compared at one shape
#   model    a shape key that is a choice of the model, not of how it is written (K/V heads, the
#            mask): a row's shape like any shape key, and the effects also pair one way across
#            its values, to say what the model's choice buys (harness/report/effects.py)
#   way      a way of writing attention at a shape (variant, cache style, compile, SDPA pin)
#   machine  where a row ran (CPU threads): part of its identity in a run, not matched across
#            two runs (an A/B usually changes it)
#   measure  how a point is measured (timing, profiling, check_only): not its shape or way, but
#            part of its config hash (it changes the figures)
#   run      how the run goes (resume, timeouts, where reports go): in no identity
ROLES = ("shape", "model", "way", "machine", "measure", "run")


def key(
    default,
    help: str,
    role: str | None = None,
    choices: tuple | None = None,
    after: str | None = None,
):
    """A config key: its default, its one line of help (docs/reference.md), for a top-level key
    its role (``ROLES``), and for a key with a fixed set of values its ``choices``: validated,
    what a variant may declare (harness/way/capabilities.py) and ``{choices}`` in the help. A
    model feature's key (harness/features/) says which key it comes ``after`` in the config."""
    if choices is not None:
        if "{choices}" not in help:  # the values are said once, by the tuple
            raise ValueError(f"a key with choices says them with {{choices}} in its help: {help}")
        help = help.replace("{choices}", "|".join(choice_text(c) for c in choices))
    metadata = {"help": help, "role": role, "choices": choices, "after": after}
    if isinstance(default, type):  # a nested group of keys
        return field(default_factory=default, metadata=metadata)
    return field(default=default, metadata=metadata)
