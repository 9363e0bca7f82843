import sys

from rmsnorm_deploy.cli import main

sys.exit(main())
