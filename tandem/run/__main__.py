"""``python -m tandem.run --nproc-per-node 2 train.py``: see :mod:`tandem.run`."""

import sys

from tandem.run import main

if __name__ == "__main__":
    sys.exit(main())
