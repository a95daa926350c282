import sys

from onpolicy.upstream.cli import main

sys.exit(main())
