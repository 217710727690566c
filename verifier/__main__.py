"""``python -m verifier serve|check|bench``."""

import sys

from verifier.cli import main

sys.exit(main())
