"""``python -m capturestore.cli``."""
import sys

from capturestore.cli import main

sys.exit(main())
