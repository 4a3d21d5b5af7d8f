"""CONTRIBUTING.md's example part is true: it registers, passes register()'s checks and trains nothing wrong;
and its LoRA section refuses what the code refuses.

The example is run in a fresh interpreter (a part registered here would stay in this process's
registry for every later test), from a folder holding only the module, as a user would.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHECK = """
import gin, torch
from polgrad import config, registry
gin.parse_config('import my_estimators')
entry = registry.lookup('advantage', 'median_baseline')
assert entry.meta['needs_groups'] and entry.meta['level'] == 'sequence', entry.meta
config.parse_config(['registry/grpo.gin'], ['Algorithm.advantage = @advantage.median_baseline'])
_, algo, _ = config.build()
mask = torch.ones(6, 3, dtype=torch.float64)
batch = dict(mask=mask, group_ids=torch.tensor([0, 0, 0, 1, 2, 2]),
             old_logp=torch.zeros(6, 3, dtype=torch.float64),
             scores=torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 1.0], dtype=torch.float64),
             truncated=torch.zeros(6, dtype=torch.bool))
out, _ = algo.prepare(batch, kl_coef=algo.kl_coef)
# group 0 rewards (1, 0, 0.5): median 0.5; group 1 alone: its own reward; group 2 (0, 1), an even
# group: median 0.5, the mean of its two middle values (Tensor.median() gives 0.0: advantages 0, 1)
assert out['adv'][:, 0].tolist() == [0.5, -0.5, 0.0, 0.0, -0.5, 0.5], out['adv']
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


def _build(*bindings: str) -> None:
    import gin

    from polgrad.config import build, parse_config

    gin.clear_config()
    try:
        parse_config([str(REPO / "registry" / "ppo_lora.gin")], ["train.steps = 4", *bindings])
        build()
    finally:
        gin.clear_config()


def test_the_lora_section_refuses_only_what_the_code_refuses():
    """CONTRIBUTING's LoRA section once said LoRA with vLLM or with async rollouts is refused, while the
    code (and README) run both: each builds with LoRA here, and the one refusal the section quotes is
    the line build() gives (asynchronous LoRA at ZeRO-3)."""
    import pytest

    from polgrad.errors import ConfigError

    text = (REPO / "CONTRIBUTING.md").read_text()
    section = " ".join(text.split("## LoRA", 1)[1].split("\n## ", 1)[0].split())
    quoted = re.search(r"refused in one line \([^`]*`([^`]+)`\)", section)
    assert quoted, "CONTRIBUTING.md's LoRA section must quote the one-line error of what LoRA refuses"
    refusals = [s for s in re.split(r"(?<=\.) (?=[A-Z])", section) if "refused" in s]
    assert refusals and all("ZeRO-3" in s for s in refusals), refusals  # nothing else is refused
    _build("train.rollout_backend = 'vllm'")
    _build("train.max_staleness = 1")
    with pytest.raises(ConfigError) as e:
        _build("train.max_staleness = 1", "train.zero_stage = 3")
    assert str(e.value).startswith(quoted.group(1)), (quoted.group(1), str(e.value))
