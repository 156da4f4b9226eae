"""``python -m ckpt_tools.cli``: the command line, as the ``ckpt-tools`` console script runs it."""
import sys

from .entry import main

sys.exit(main())
