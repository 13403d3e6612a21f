"""`python -m server [flags]`: the same as `pagoda serve [flags]`."""

import sys

from server.cli import serve

sys.exit(serve(prog="python -m server"))
