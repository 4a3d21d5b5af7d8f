"""`python -m polgrad.sweep experiments/X.gin`: see the polgrad.sweep package docstring."""

from polgrad.sweep.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
