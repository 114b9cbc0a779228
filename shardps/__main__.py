import sys

from shardps.cli import main

sys.exit(main())
