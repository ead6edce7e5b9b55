"""``python -m kvrace ...``: the same as the ``kvrace`` console script."""
import sys

from kvrace.cli import main

sys.exit(main())
