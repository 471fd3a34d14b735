"""``python -m ds_dynatrain.cli``: the ``dynatrain`` command."""

import sys

from .main import main

if __name__ == "__main__":
    sys.exit(main())
