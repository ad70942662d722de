import sys

from plait.cli.main import main

sys.exit(main())
