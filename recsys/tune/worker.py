"""``python -m recsys.tune.worker``: one worker of ``recsys tune --jobs K`` (options on stdin)."""

import sys

from recsys.tune.run import worker_main

if __name__ == "__main__":
    sys.exit(worker_main())
