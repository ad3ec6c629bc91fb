"""``python -m netsim ...``: the same as ``splitspec netsim ...`` without loading the rest of splitspec."""

import sys

from shared.cli import main

sys.exit(main(["netsim", *sys.argv[1:]]))
