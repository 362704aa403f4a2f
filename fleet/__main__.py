"""``python -m fleet``: the same as the ``tidegate`` console script."""

from fleet.cli import main

raise SystemExit(main())
