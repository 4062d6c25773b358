"""``python -m triforce.serve [serve options]``: ``triforce serve`` without the rest of the command line."""

import sys

from ..cli.serve import main_for_tests

sys.exit(main_for_tests())
