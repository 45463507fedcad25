"""Reconstruct post-hoc EMA models from power-function EMA snapshots; see ``--help``.

Thin wrapper around ``diffusers_scalelong.ema.cli.main``.
"""

import sys

from diffusers_scalelong.ema.cli import main

if __name__ == "__main__":
    sys.exit(main())
