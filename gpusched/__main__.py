import sys

from gpusched.cli import main

sys.exit(main())
