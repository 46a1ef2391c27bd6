import sys

from kvserve.commands import main

sys.exit(main())
