import os
import sys

# Hydra's own errors (unknown preset or variant, bad override syntax, unknown key) reach us
# instead of Hydra's multi-line report, so that they read like every other refusal: one
# `error:` line and exit 2 (README "When something goes wrong").
os.environ.setdefault("HYDRA_FULL_ERROR", "1")

from hydra.errors import HydraException  # noqa: E402
from omegaconf.errors import OmegaConfBaseException  # noqa: E402

from harness.run import main, refusal  # noqa: E402

if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # a single run, or a sweep whose sweeper does not handle it
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
    except (HydraException, OmegaConfBaseException) as e:
        print(f"error: {refusal(e)}", file=sys.stderr)
        sys.exit(2)
