"""``python -m witness.cli``."""

import sys

from . import main

sys.exit(main())
