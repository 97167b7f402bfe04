"""``python -m tlt_trainers.settings``: rewrite (or ``--check``) the files generated from the settings."""

from .generated import main

raise SystemExit(main())
