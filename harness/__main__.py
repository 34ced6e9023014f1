"""``python -m harness`` runs the ``harness`` command."""

import sys

from harness.cli import main

sys.exit(main())
