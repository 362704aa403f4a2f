"""``python -m tidegate``: the same as the ``tidegate`` console script."""

from tidegate.cli import main

raise SystemExit(main())
