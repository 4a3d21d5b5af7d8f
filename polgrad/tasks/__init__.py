"""Built-in tasks (kind `task`) and the loader for a user's jsonl/parquet prompt file."""

# registers task.add/sort/reverse, task.running_sum, task.file, task.reasoning_gym
from polgrad.tasks import files, gym, running_sum, synthetic  # noqa: F401
from polgrad.tasks.base import Example, Task  # noqa: F401
