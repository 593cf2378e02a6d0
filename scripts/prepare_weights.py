"""Prepare the default weights into weights/: a thin wrapper kept for old habits and the Dockerfile-era
command line. The code lives in attnlab_prepare.py (importable from the installed package, `pip install -e .`);
`attnlab prepare` is the same command."""
from __future__ import annotations

import sys

from attnlab_prepare import main

if __name__ == "__main__":
    sys.exit(main())
