"""``python -m hf_dspark.cli``: the ``hf-dspark`` command without the console script."""

import sys

from . import main

sys.exit(main())
