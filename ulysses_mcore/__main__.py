"""``python -m ulysses_mcore COMMAND``: the ``ulysses-mcore`` command (:mod:`ulysses_mcore.cli`)."""

import sys

from .cli import main

sys.exit(main())
