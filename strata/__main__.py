"""`python -m strata` is the `strata` command."""

import sys

from strata.cli import main

sys.exit(main())
