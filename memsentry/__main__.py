"""``python -m memsentry`` is the ``memsentry`` command."""

import sys

from memsentry.cli import main

sys.exit(main())
