"""``python -m deltackpt``: the ``deltackpt`` command (see :mod:`deltackpt.app.cli`)."""

import sys

from deltackpt.app.cli import main

if __name__ == "__main__":
    sys.exit(main())
