import sys

from harness.run import main

if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # a single run, or a sweep whose sweeper does not handle it
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
