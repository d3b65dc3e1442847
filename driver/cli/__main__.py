"""`python -m driver.cli`: the same as `fgpu`."""

import sys

from driver.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
