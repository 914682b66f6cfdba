"""`python -m glassgpt` (and `torchrun -m glassgpt`) run the command line."""

import sys

from glassgpt.cli import main

sys.exit(main())
