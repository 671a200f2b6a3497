"""``python -m paddle_hybrid.dryrun``: see :mod:`paddle_hybrid.dryrun`."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
