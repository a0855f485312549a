"""``python -m sptransform``: the same as the ``sptransform`` command."""

import sys

from sptransform.cli import main

sys.exit(main())
