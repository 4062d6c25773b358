"""``python -m triforce``: the same as the ``triforce`` command."""

import sys

from .cli import main

sys.exit(main())
