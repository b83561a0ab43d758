"""``python -m harness [overrides]``: one point, or a sweep with -m (Hydra; harness/run.py)."""

import os
import sys

if __name__ == "__main__":
    # The worker that runs the points (harness/worker.py) starts first, so that it imports
    # torch while this process does.
    from harness.worker import WORKER  # imports nothing heavy

    WORKER.start()
    # Hydra's own errors (unknown preset or variant, bad override syntax, unknown key) reach us
    # instead of Hydra's multi-line report, so that they read like every other refusal: one
    # `error:` line and exit 2 (README "When something goes wrong").
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from harness.run import main, refusal, scoped_variant_options

    sys.argv[1:] = scoped_variant_options(sys.argv[1:])
    try:
        main()
    except KeyboardInterrupt:  # a single run, or a sweep whose sweeper does not handle it
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
    except (HydraException, OmegaConfBaseException) as e:
        print(f"error: {refusal(e)}", file=sys.stderr)
        sys.exit(2)
