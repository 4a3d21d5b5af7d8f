"""polgrad imports deepspeed without its autotuner's optional mlflow import (polgrad.distributed.
import_deepspeed): 3.7 s of every trainer process's start where mlflow is installed, for an
autotuner polgrad never runs. The tracker still gets mlflow afterwards."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

HAS_MLFLOW = importlib.util.find_spec("mlflow") is not None


def _fresh(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip().splitlines()[-1]


# (a fresh interpreter's script, what its last line prints)
NOT_IMPORTED_FIRST = (  # deepspeed without mlflow; mlflow imports afterwards
    "from polgrad.distributed import import_deepspeed\n"
    "ds = import_deepspeed()\n"
    "before = ('mlflow' in sys.modules, ds is sys.modules['deepspeed'], import_deepspeed() is ds)\n"
    "import mlflow\n"
    "print(before, type(mlflow).__name__)",
    "(False, True, True) module",
)
IMPORTED_FIRST = (  # an mlflow imported before is left as it is
    "import mlflow\n"
    "from polgrad.distributed import import_deepspeed\n"
    "import_deepspeed()\n"
    "print(sys.modules['mlflow'] is mlflow)",
    "True",
)


@pytest.mark.skipif(not HAS_MLFLOW, reason="mlflow is not installed: deepspeed cannot import it anyway")
@pytest.mark.parametrize(
    ("script", "printed"), [NOT_IMPORTED_FIRST, IMPORTED_FIRST], ids=["fresh", "mlflow_first"]
)
def test_deepspeed_is_imported_without_mlflow_and_an_imported_mlflow_stays(script, printed):
    assert _fresh("import os, sys; os.environ.setdefault('DS_ACCELERATOR', 'cpu')\n" + script) == printed
