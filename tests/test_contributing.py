"""CONTRIBUTING.md's example part is true: it registers, passes register()'s checks and trains nothing wrong.

The example is run in a fresh interpreter (a part registered here would stay in this process's
registry for every later test), from a folder holding only the module, as a user would.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHECK = """
import gin, torch
from polgrad import config, registry
gin.parse_config('import my_estimators')
entry = registry.lookup('advantage', 'median_baseline')
assert entry.meta['needs_groups'] and entry.meta['level'] == 'sequence', entry.meta
config.parse_config(['registry/grpo.gin'], ['Algorithm.advantage = @advantage.median_baseline'])
_, algo, _ = config.build()
mask = torch.ones(4, 3, dtype=torch.float64)
batch = dict(mask=mask, group_ids=torch.tensor([0, 0, 0, 1]), old_logp=torch.zeros(4, 3, dtype=torch.float64),
             scores=torch.tensor([1.0, 0.0, 0.5, 1.0], dtype=torch.float64),
             truncated=torch.zeros(4, dtype=torch.bool))
out, _ = algo.prepare(batch, kl_coef=algo.kl_coef)
# group 0 rewards (1, 0, 0.5): median 0.5; group 1 alone: its own reward
assert out['adv'][:, 0].tolist() == [0.5, -0.5, 0.0, 0.0], out['adv']
print('ok')
"""


def test_the_contributing_example_part_registers_and_runs(tmp_path):
    text = (REPO / "CONTRIBUTING.md").read_text()
    code = re.search(r"```python\n# my_estimators.py\n(.*?)```", text, re.S)
    assert code, "CONTRIBUTING.md's example part (```python # my_estimators.py) is missing"
    (tmp_path / "my_estimators.py").write_text(code.group(1))
    env_path = f"{tmp_path}"
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import os, sys; sys.path.insert(0, {env_path!r}); os.chdir({str(REPO)!r})\n" + CHECK,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-2000:]
