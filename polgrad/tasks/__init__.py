"""Built-in tasks (kind `task`) and the loader for a user's jsonl/parquet prompt file."""

from polgrad.tasks import files, synthetic  # noqa: F401  (registers task.add/sort/reverse and task.file)
from polgrad.tasks.base import Example, Task  # noqa: F401
