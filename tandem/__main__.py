"""``python -m tandem ...``: the ``tandem`` command, where its script is not on PATH."""

import sys

from tandem.entrypoints.cli import main

if __name__ == "__main__":  # importing the module (a walk over the package) runs nothing
    sys.exit(main())
