import sys

from kvprof.cli import main

sys.exit(main())
