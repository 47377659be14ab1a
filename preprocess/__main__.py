"""``python -m preprocess`` entry point."""

import sys

from preprocess.cli import main

sys.exit(main())
