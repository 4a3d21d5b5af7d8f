"""Re-export kept for code written against the old path: use `polgrad.checks`."""

from polgrad.checks import check_b, check_bt, require, zero_pad  # noqa: F401
