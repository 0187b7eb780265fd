"""``python -m rlbench.analysis``: the ``rlbench-compare`` command."""

import sys

from rlbench.analysis.cli import main

sys.exit(main())
