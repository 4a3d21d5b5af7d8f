"""polgrad: policy-gradient RL for language models, composed from small named parts."""

import polgrad.components  # noqa: F401  (registers the built-in parts)
import polgrad.tasks  # noqa: F401  (registers the built-in tasks)
from polgrad.registry import get, lookup, register  # noqa: F401

__version__ = "0.1.0"
