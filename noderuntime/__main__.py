"""``python -m noderuntime`` runs the command line."""

import sys

from noderuntime.cli import main

sys.exit(main())
