"""``python -m omnistage_worker``: the same as the ``omnistage-worker`` command."""

import sys

from omnistage_worker.cli import main

sys.exit(main())
