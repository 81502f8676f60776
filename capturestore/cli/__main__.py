"""``python -m capturestore.cli``."""
from capturestore.cli import console_main

console_main()
