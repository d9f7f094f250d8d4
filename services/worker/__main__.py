import sys

from shoal.services.worker.main import main

sys.exit(main())
