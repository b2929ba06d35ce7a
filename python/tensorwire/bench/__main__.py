"""``python -m tensorwire.bench SUITE ...``: see :mod:`tensorwire.bench`."""

import sys

from tensorwire.bench import main

sys.exit(main())
