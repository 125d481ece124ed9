"""``python -m partita.cli ...``: the ``partita`` command, where it is not installed as one."""

import sys

from partita.cli.main import main

sys.exit(main())
