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
    "kernels": ("harness.way.kernels", "the attention kernels, what each declares, their order"),
}


def run(argv: list[str]) -> int:
    """``python -m harness`` / ``mha-bench run``: Hydra reads the overrides from sys.argv."""
    from harness.sweep.worker import WORKER  # imports nothing heavy

    WORKER.start()
    # Hydra's own errors (unknown preset or variant, bad override syntax, unknown key) reach us
    # instead of Hydra's multi-line report, so that they read like every other refusal: one
    # `error:` line and exit 2 (docs/guide.md, "When something goes wrong").
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from harness.sweep.run import main, refusal, scoped_variant_options

    sys.argv[1:] = scoped_variant_options(argv)
    try:
        main()
    except KeyboardInterrupt as e:  # before the run started, or a sweeper that does not handle it
        from harness.errors import Terminated
        from harness.results import EXIT_INTERRUPTED, EXIT_TERMINATED

        print(
            "\nterminated (SIGTERM)" if isinstance(e, Terminated) else "\ninterrupted",
            file=sys.stderr,
        )
        return EXIT_TERMINATED if isinstance(e, Terminated) else EXIT_INTERRUPTED
    except (HydraException, OmegaConfBaseException) as e:
        print(f"error: {refusal(e)}", file=sys.stderr)
        return 2
    return 0


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
    if command == "run":
        return run(rest)
    return importlib.import_module(COMMANDS[command][0]).main(rest)


if __name__ == "__main__":
    sys.exit(main())
