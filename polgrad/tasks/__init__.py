"""Built-in tasks (kind `task`) and the loader for a user's jsonl/parquet prompt file."""

from polgrad.tasks.base import Example, Task  # noqa: F401
