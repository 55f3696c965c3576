"""`python -m bench [options]` from the repository root: see `cli.py`."""

import sys

from .cli import main

sys.exit(main())
