"""The on-disk cache of trained checkpoints (SFT warm starts, reward models) and their polgrad.json.

Checkpoints are ordinary Hugging Face directories (`save_pretrained` of model and tokenizer) plus a
`polgrad.json` that records how they were made. SFT and reward-model runs (polgrad.pretrain) are
cached under `cache_dir` (default: `$POLGRAD_CACHE`, else `<repo>/.cache/polgrad` when polgrad runs
from its source tree, else `<cwd>/.cache/polgrad`), keyed by a hash of everything that determines the
weights: the task name and kwargs, a digest of the data actually drawn, the model kwargs, the
training hyperparameters, the seed and `MODEL_CODE_VERSION`. A cache entry appears by an atomic rename
of a finished temporary directory, so a killed run never leaves a half-written entry, and a per-key
file lock makes concurrent sweep cells train it only once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Bump when a change in polgrad.models or polgrad.pretrain changes the weights that warm_start /
# train_reward_model produce: it is part of every cache key, so stale entries are simply never hit again.
# 3: load_tokenizer keeps the character tokenizer as saved (the reward model of task.sort/reverse now
# reads the space of 'sort 31524=' that transformers 5's Qwen2Tokenizer dropped).
MODEL_CODE_VERSION = 3

POLGRAD_JSON = "polgrad.json"


def default_cache_dir() -> Path:
    """`$POLGRAD_CACHE`, else `<repo>/.cache/polgrad` in a source checkout, else `<cwd>/.cache/polgrad`."""
    env = os.environ.get("POLGRAD_CACHE")
    if env:
        return Path(env).expanduser()
    repo = Path(__file__).resolve().parents[2]  # polgrad/models/cache.py -> the checkout
    if (repo / "pyproject.toml").is_file() and (repo / "polgrad").is_dir():
        return repo / ".cache" / "polgrad"
    return Path.cwd() / ".cache" / "polgrad"


def digest(obj: Any) -> str:
    """sha256 hex of the sorted-key JSON of `obj` (repr for anything JSON cannot encode): a cache key."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=repr).encode("utf-8")).hexdigest()


def cache_root(cache_dir: str | os.PathLike | None) -> Path:
    """`cache_dir` (user-expanded), or `default_cache_dir()` when None."""
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


@contextlib.contextmanager
def cache_entry(root: Path, name: str) -> Iterator[tuple[Path, Path | None]]:
    """Lock the cache key `name` under `root`; yield (final path, tmp dir to fill or None on a hit).

    On a miss the caller fills the tmp dir; on a clean exit it is renamed onto the final path (atomic
    on one filesystem); on an exception it is deleted. Leftover tmp dirs of killed runs are removed the
    next time the key is locked (holding the lock proves nobody else is writing them).
    """
    root.mkdir(parents=True, exist_ok=True)
    final = root / name
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if (final / POLGRAD_JSON).is_file():
                yield final, None
                return
            for stale in root.glob(f".tmp-{name}-*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp = root / f".tmp-{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            tmp.mkdir()
            try:
                yield final, tmp
                if not (tmp / POLGRAD_JSON).is_file():
                    raise RuntimeError(f"cache entry {tmp} was not completed (no {POLGRAD_JSON})")
                if final.exists():  # an incomplete entry left by hand: replace it
                    shutil.rmtree(final)
                os.rename(tmp, final)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def read_info(path: str | os.PathLike) -> dict[str, Any]:
    """The `polgrad.json` of a checkpoint made by polgrad ({} if there is none)."""
    f = Path(path) / POLGRAD_JSON
    return json.loads(f.read_text()) if f.is_file() else {}


def write_info(path: Path, info: dict[str, Any]) -> None:
    """Write `info` as the checkpoint's polgrad.json (sorted keys, indented)."""
    (path / POLGRAD_JSON).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


def checkpoint_fingerprint(path: Path) -> dict[str, Any]:
    """What identifies a policy checkpoint in a cache key: its polgrad.json key, or its weights' stat."""
    info = read_info(path)
    if "key" in info:
        return {"key": info["key"]}
    files = sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin"))
    return {
        "path": str(path.resolve()),
        "files": [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files],
    }
