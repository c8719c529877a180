"""`python -m kvfold.bench ...` is the same as `kvfold bench ...`."""

from kvfold.bench.runner import main

raise SystemExit(main())
