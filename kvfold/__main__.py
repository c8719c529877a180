"""`python -m kvfold ...` is the same as the `kvfold` command."""

from kvfold.cli import main

raise SystemExit(main())
