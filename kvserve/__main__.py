import sys

from kvserve.cli import main

sys.exit(main())
