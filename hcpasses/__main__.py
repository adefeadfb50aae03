"""``python -m hcpasses demo``: see hcpasses.demo."""

import sys

from hcpasses.testing.demo import main

if __name__ == "__main__":
    sys.exit(main())
