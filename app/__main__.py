"""``python -m app``: the same as ``kvoffload serve``."""

import sys

from app.main import run

sys.exit(run(sys.argv[1:]))
