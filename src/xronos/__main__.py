"""``python -m xronos`` == ``xronos``."""

import sys

from xronos.cli import main

sys.exit(main())
