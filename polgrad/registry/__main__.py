"""`python -m polgrad.registry [--table]`: list every part, or print the chapter's Table 5."""

from polgrad.registry import main

raise SystemExit(main())
