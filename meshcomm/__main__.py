"""`python -m meshcomm ...`: the same as the `meshcomm` command (meshcomm.tools.cli)."""
import sys

from .tools.cli import main

sys.exit(main())
