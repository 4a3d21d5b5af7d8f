"""`python -m polgrad.registry [--table]`: list every part, or print the chapter's Table 5."""

from __future__ import annotations

import argparse

import polgrad  # noqa: F401  (registers the built-in parts)
from polgrad.registry import describe


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m polgrad.registry",
        description="List every kind (call signature, metadata keys) and every registered part.",
    )
    ap.add_argument("--table", action="store_true", help="print the chapter's Table 5 for every spec")
    ap.add_argument("--specs", default=None, help="folder of spec gin files (default: registry/)")
    args = ap.parse_args(argv)
    if args.table:
        from polgrad.config import comparison_table

        print(comparison_table(args.specs))
    else:
        print(describe())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
