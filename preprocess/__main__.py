"""``python -m preprocess`` entry point."""

import sys

from preprocess.arguments import main

sys.exit(main())
