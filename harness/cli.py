"""The command line: ``mha-bench run|report|compare|paired|tensorboard ...`` (pyproject's console
script). The older forms stay as aliases: ``python -m harness`` (run), ``python -m
harness.report``, ``python -m harness.compare``, ``python -m harness.tensorboard``.

Nothing heavy is imported here: ``run`` starts the worker first, so that it imports torch while
this process imports Hydra.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

# command -> (module whose main(argv) it runs, what it does)
COMMANDS = {
    "run": ("harness.sweep.run", "one point, or a Hydra sweep with -m (config keys as overrides)"),
    "report": ("harness.report.render", "(re)render the HTML report of a run or sweep dir"),
    "compare": (
        "harness.report.compare",
        "A/B: the same points in two runs, with intervals and verdicts",
    ),
    "paired": (
        "harness.report.paired",
        "any two ways of a sweep paired round by round: --ways LABEL_A LABEL_B",
    ),
    "tensorboard": ("harness.report.tensorboard", "open a run's profiler traces in TensorBoard"),
    "race": (
        "harness.cli",
        "your module against every built-in way at your shape, ending with which to use",
    ),
    "kernels": ("harness.way.kernels", "the attention kernels, what each declares, their order"),
}


def importable(argv: list[str]) -> None:
    """The current directory and every ``--config-dir`` on sys.path (last, so that nothing
    installed is shadowed), as ``python -m`` puts the first: a variant's ``_target_`` beside its
    yaml (``mine.MyAttention`` for DIR/mine.py, ``examples.mine.MyAttention`` from this
    repository) imports without PYTHONPATH. The worker starts with this process's sys.path."""
    dirs = [os.getcwd()]
    for i, arg in enumerate(argv):
        if arg in ("--config-dir", "-cd") and i + 1 < len(argv):
            dirs.append(argv[i + 1])
        elif arg.startswith("--config-dir="):
            dirs.append(arg.partition("=")[2])
    for d in map(os.path.abspath, dirs):
        if d not in sys.path:
            sys.path.append(d)


def run(argv: list[str]) -> int:
    """``python -m harness`` / ``mha-bench run``: Hydra reads the overrides from sys.argv."""
    from harness.sweep.worker import WORKER  # imports nothing heavy

    importable(argv)
    WORKER.start()
    # Hydra's own errors (unknown preset or variant, bad override syntax, unknown key) reach us
    # instead of Hydra's multi-line report, so that they read like every other refusal: one
    # `error:` line and exit 2 (docs/guide.md, "When something goes wrong").
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from harness.files import Unwritable
    from harness.results import EXIT_WRITE
    from harness.sweep.run import main, refusal, scoped_variant_options

    sys.argv[1:] = scoped_variant_options(argv)
    try:
        main()
    except (KeyboardInterrupt, Exception, Unwritable) as e:  # Unwritable: a BaseException
        from harness.errors import stop_code, stop_said, stop_within

        stop = stop_within(e)  # a stop, or one a library's cleanup turned into its own error
        if stop is not None:  # before the run started, or a sweeper that does not handle it
            print(f"\n{stop_said(stop)}", file=sys.stderr)
            return stop_code(stop)
        if isinstance(e, (HydraException, OmegaConfBaseException)):
            print(f"error: {refusal(e)}", file=sys.stderr)
            return 2
        if yaml_error(e):  # a config file Hydra could not parse (a variant's yaml, say)
            print(f"error: {yaml_error(e)}", file=sys.stderr)
            return 2
        if isinstance(e, Unwritable):  # a single run's row (a sweep's: its sweeper's cut_short)
            print(f"error: {e.error.strerror} (make room or make it writable, then run it "
                  "again)", file=sys.stderr)  # fmt: skip
            return EXIT_WRITE
        raise
    return 0


def yaml_error(e: BaseException) -> str:
    """A YAML syntax error in one line, naming the file, the line and the column ("" for any
    other error): a variant yaml with a typo ended ``run -m`` and ``race`` in a traceback."""
    import yaml

    if not isinstance(e, yaml.YAMLError):
        return ""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    where = f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}" if mark else "a yaml"
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    return f"cannot read {where}: {problem} (a YAML syntax error: fix the file)"


RACE_USAGE = """usage: mha-bench race VARIANT [--config-dir DIR] [OVERRIDES...]

Your module against every built-in way at your shape: checks each against nn.MultiheadAttention,
times them in interleaved rounds and ends with which way to use, which of its factors matter
there, and how your module compares ("your module mine is 1.66x [1.53, 1.80] slower than it").
VARIANT is your variant's yaml name (DIR/variant/VARIANT.yaml; several: a,b); OVERRIDES set the
shape and anything else, as for run (seq_len=512 dtype=bfloat16 mask=causal compile=off,default).

  mha-bench race mine --config-dir mydir seq_len=512 mask=causal"""


def race(argv: list[str]) -> int:
    """``mha-bench race VARIANT [overrides]``: sweep=race with ``variant=VARIANT,<built-ins>``,
    the built-in ways being the files of conf/variant (conf/sweep/race.yaml)."""
    if not argv or argv[0] in ("-h", "--help"):
        print(RACE_USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    mine, rest = argv[0], argv[1:]
    if "=" in mine or mine.startswith("-"):
        print(f"error: {mine!r} is not a variant name: mha-bench race VARIANT ...", file=sys.stderr)
        return 2
    from harness.factory import CONF_VARIANTS

    flags, overrides = hydra_flags(rest)
    built_in = sorted(p.stem for p in CONF_VARIANTS.glob("*.yaml"))
    # latent attention's way runs at kv_lora_rank > 0 only: raced where the race is at one
    latent = any(o.partition("=")[0] == "kv_lora_rank" and o.partition("=")[2] not in ("", "0")
                 for o in overrides)  # fmt: skip
    built_in = [n for n in built_in if n != "latent" or latent]
    ways = ",".join(dict.fromkeys([*mine.split(","), *built_in]))
    named = [o for o in overrides if o.partition("=")[0].lstrip("+~") == "variant"]
    if named:  # it would race that alone, without a word (issue 74)
        print(
            f"error: {named[0]}: race takes your variant as its first argument and races it "
            "against every built-in way (mha-bench race VARIANT ...); drop variant=",
            file=sys.stderr,
        )
        return 2
    for name in mine.split(","):  # yours named like a built-in: Hydra would read one of the two
        theirs = CONF_VARIANTS / f"{name}.yaml"
        yours = [d / "variant" / f"{name}.yaml" for d in config_dirs(flags)]
        shadow = next((p for p in yours if p.is_file()), None)
        if shadow is not None and theirs.is_file():
            print(
                f"error: {shadow} has the name of a built-in way ({theirs}), which the race "
                "runs too: rename yours",
                file=sys.stderr,
            )
            return 2
    from harness.validate import InvalidPoint

    try:
        fixed = fixed_keys(mine.split(","), flags, overrides)
    except InvalidPoint as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if fixed:  # your module's shape is every way's: the built-in ways run with its fixed keys
        print(f"race: every way runs with your variant's _fixed_ keys: {' '.join(fixed)}")
    return run([*flags, "-m", "sweep=race", f"variant={ways}", *fixed, *overrides])


def fixed_keys(variants: list[str], flags: list[str], overrides: list[str]) -> list[str]:
    """The ``_fixed_`` keys of ``variants``' yaml files (in each ``--config-dir``'s variant/, then
    conf/variant), as overrides, leaving out the keys the command line sets. (Keys fixed by a
    class attribute show at the sweep's end: that shape has no built-in way to race.)"""
    import yaml

    from harness.declarations import parse_declaration
    from harness.factory import CONF_VARIANTS

    dirs = [d / "variant" for d in config_dirs(flags)]
    given = {o.partition("=")[0].lstrip("+~") for o in overrides}
    out: dict[str, str] = {}
    for name in variants:
        path = next(
            (d / f"{name}.yaml" for d in [*dirs, CONF_VARIANTS] if (d / f"{name}.yaml").is_file()),
            None,
        )
        try:
            fixed = (yaml.safe_load(path.read_text()) or {}).get("_fixed_") if path else None
        except (OSError, yaml.YAMLError, AttributeError):
            fixed = None  # the sweep refuses a damaged yaml in its own words
        # checked before every way is given them (InvalidPoint): a bad value was refused only
        # after the sweep's dir was made (issue 74)
        parse_declaration(fixed, f"variant={name}: _fixed_", "_fixed_")
        for key, value in (fixed if isinstance(fixed, dict) else {}).items():
            if key not in given:
                out[key] = str(value).lower() if isinstance(value, bool) else str(value)
    return [f"{k}={v}" for k, v in out.items()]


def config_dirs(flags: list[str]) -> list[Path]:
    """The ``--config-dir`` (``-cd``) dirs among Hydra's flags, in order."""
    dirs = [Path(v) for f, v in zip(flags, flags[1:]) if f in ("--config-dir", "-cd")]
    return dirs + [Path(f.partition("=")[2]) for f in flags if f.startswith("--config-dir=")]


# Hydra's flags that take a value as the next argument (hydra/_internal/utils.py, get_args_parser)
VALUED = {"--config-dir", "-cd", "--config-path", "-cp", "--config-name", "-cn", "--cfg", "-c"}
VALUED |= {"--package", "-p", "--experimental-rerun"}


def hydra_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """``argv`` split into Hydra's flags (with their values) and the overrides: Hydra's parser
    takes its overrides as one run of positional arguments, so ours go after every flag."""
    flags, overrides, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("-"):
            flags.append(arg)
            if arg in VALUED and i + 1 < len(argv):
                flags.append(argv[i + 1])
                i += 1
        else:
            overrides.append(arg)
        i += 1
    return flags, overrides


def usage() -> str:
    lines = ["usage: mha-bench COMMAND [ARGS]", ""]
    lines += [f"  {name:<12} {what}" for name, (_, what) in COMMANDS.items()]
    lines += ["", "mha-bench COMMAND --help for a command's arguments (run: Hydra's --help)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(
            f"error: {command!r} is not a command of mha-bench ({'|'.join(COMMANDS)})",
            file=sys.stderr,
        )
        return 2
    if command in ("run", "race"):
        return {"run": run, "race": race}[command](rest)
    return importlib.import_module(COMMANDS[command][0]).main(rest)


def console() -> None:
    """The ``mha-bench`` command (pyproject's console script): ``main``, then ``leave``."""
    from harness.leaving import leave

    leave(main)


if __name__ == "__main__":
    console()
