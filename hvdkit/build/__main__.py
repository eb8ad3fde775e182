import sys

from hvdkit.build.builder import main

sys.exit(main())
