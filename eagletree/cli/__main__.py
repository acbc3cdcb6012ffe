"""`python -m eagletree.cli`: the `eagletree` command, run in place."""

import sys

from . import main

sys.exit(main())
