"""The on-disk cache of trained checkpoints (SFT warm starts, reward models) and their polgrad.json.

Checkpoints are ordinary Hugging Face directories (`save_pretrained` of model and tokenizer) plus a
`polgrad.json` that records how they were made. SFT and reward-model runs (polgrad.pretrain) are
cached under `cache_dir` (default: `$POLGRAD_CACHE`, else `<repo>/.cache/polgrad` when polgrad runs
from its source tree, else `<cwd>/.cache/polgrad`), keyed by a hash of everything that determines the
weights: the task name and kwargs, a digest of the data actually drawn, the model kwargs, the
training hyperparameters, the seed and `MODEL_CODE_VERSION`. A cache entry appears by an atomic rename
of a finished temporary directory, so a killed run never leaves a half-written entry, and a per-key
file lock makes concurrent sweep cells train it only once.

A hit is checked before it is trusted (`entry_problem`): a weights file deleted or truncated after the
entry was made (a disk cleaner, a full disk while copying a cache) would otherwise be a hit on which
every run fails while loading, and is never rebuilt. The check is cheap: every file's size against the
sizes polgrad.json records (`files`, written when the entry is made), and for every entry, older ones
included, a config.json that parses, a weights file, and each safetensors file as long as its own
header says. A broken entry is rebuilt under the same lock, with one line on stderr saying so.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import sys
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
WEIGHTS = (
    "*.safetensors",
    "*.bin",
)  # an entry holds at least one (SFT: model.safetensors; a LoRA RM: its adapter)


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
            problem = entry_problem(final) if final.exists() else None
            if final.exists() and problem is None:
                yield final, None
                return
            if problem is not None:
                print(
                    f"warning: cache entry {final} is broken ({problem}); rebuilding it",
                    file=sys.stderr,
                    flush=True,
                )
            for stale in root.glob(f".tmp-{name}-*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp = root / f".tmp-{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            tmp.mkdir()
            try:
                yield final, tmp
                if not (tmp / POLGRAD_JSON).is_file():
                    raise RuntimeError(f"cache entry {tmp} was not completed (no {POLGRAD_JSON})")
                write_info(tmp, {**read_info(tmp), "files": _sizes(tmp)})  # what `entry_problem` checks
                if final.exists():  # a broken or incomplete entry: replace it
                    shutil.rmtree(final)
                os.rename(tmp, final)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _sizes(path: Path) -> dict[str, int]:
    """The size in bytes of every file of the entry at `path` but its polgrad.json, by relative path."""
    files = (f for f in sorted(path.rglob("*")) if f.is_file() and f.name != POLGRAD_JSON)
    return {str(f.relative_to(path)): f.stat().st_size for f in files}


def entry_problem(path: Path) -> str | None:
    """What is wrong with the finished cache entry at `path` (a few words), or None if it is whole.

    Whole: polgrad.json parses; every file it records (`files`) has its recorded size; config.json
    parses; at least one weights file; every safetensors file is as long as its header says (entries
    made before `files` was recorded are checked by these last three alone). Stats and headers only,
    no weights are read."""
    try:
        info = json.loads((path / POLGRAD_JSON).read_text())
    except (OSError, ValueError):
        return f"no readable {POLGRAD_JSON}"
    recorded = info.get("files") if isinstance(info, dict) else None
    for name, size in (recorded if isinstance(recorded, dict) else {}).items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} is {f.stat().st_size:,} bytes, {size:,} when made"
    try:
        json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return "no readable config.json"
    weights = [f for pattern in WEIGHTS for f in sorted(path.glob(pattern))]
    if not weights:
        return "no weights file"
    return next(filter(None, (_safetensors_problem(f) for f in weights if f.suffix == ".safetensors")), None)


def _safetensors_problem(f: Path) -> str | None:
    """None if the safetensors file `f` is as long as its header says: 8 bytes of header length, the
    JSON header, then the tensors up to the largest end offset; else what is wrong."""
    size = f.stat().st_size
    try:
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n)) if 8 + n <= size else None
        ends = [v["data_offsets"][1] for k, v in (header or {}).items() if k != "__metadata__"]
    except (OSError, ValueError, TypeError, KeyError, IndexError):
        header = None
    if header is None:
        return f"{f.name} has no readable header ({size:,} bytes)"
    want = 8 + n + max(ends, default=0)
    return None if size == want else f"{f.name} is {size:,} bytes, its header says {want:,}"


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
