"""``python -m tandem ...``: the ``tandem`` command, where its script is not on PATH."""

import sys

from tandem.entrypoints.cli import main

sys.exit(main())
