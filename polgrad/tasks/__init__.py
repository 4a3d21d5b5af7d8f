"""Built-in tasks (kind `task`) and the loader for a user's jsonl/parquet prompt file."""

from polgrad.tasks import files, gym, synthetic  # noqa: F401  (registers task.add/sort/reverse, task.file, task.reasoning_gym)
from polgrad.tasks.base import Example, Task  # noqa: F401
