"""``python -m deltackpt``: the ``deltackpt`` command (see :mod:`deltackpt.cli`)."""

import sys

from deltackpt.cli import main

if __name__ == "__main__":
    sys.exit(main())
