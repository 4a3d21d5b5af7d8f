"""Which checkpoint a resumed run loads: the newest one that is intact, checked before DeepSpeed reads it.

A run's checkpoints are DeepSpeed tag folders `checkpoints/<part>/step<N>/` (part: policy, and
critic when the spec has one) and a `latest` file naming the newest tag. Every tag is kept, so an
earlier one is there to fall back to. `resume_tag` checks the tags newest first and returns the
first that is intact in every part; each damaged one skipped on the way is one warning line. A tag
is intact (`problem` returns None) when its folder exists and holds a `*model_states.pt`, the ZeRO
shards `zero_pp_rank_<r>_...` are numbered 0..R without a gap, and every `.pt` file is a complete
zip archive whose members pass their CRC check (torch.save's format: a truncated or overwritten file
fails here, with its path, instead of deep inside torch.load; a file that is neither a zip archive
nor a pickle stream, torch's legacy format, fails too). `latest` is not trusted: a `latest`
naming a missing tag is reported, and the tags themselves decide.

No intact tag at all is a one-line `DataError` naming the folder and how to start over.
`python -m polgrad.export` runs the same check (`damage`) on the tag it exports.

DeepSpeed writes a tag's files itself; the `latest` file beside them is written by polgrad
(`save_engine`) atomically, once every file of the tag is written.

This module owns a run's checkpoints whole: writing one (`save`: every engine's tag, the async
sampler's older weights, then the `complete.json` marker, then, with train.keep_checkpoints = N,
the removal of every tag older than the N newest: `prune`), which one a resume loads (`resume_tag`),
loading it (`load_part`), the integrity check (`problem`, `damage`), and one engine's DeepSpeed
checkpoint with every rank's RNG states (`save_engine`, `load_engine`).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import sys
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from polgrad.errors import ConfigError, DataError, PolgradError, WriteError, is_write_failure, write_error
from polgrad.io import atomic_write_text
from polgrad.run_folder import RunFolder

TAG = re.compile(r"step(\d+)")
# checkpoints/complete.json: {"step": N, "parts": [...]} of the newest checkpoint whose every part (and
# every rank's files) is written; rank 0 writes it last (`save`).
COMPLETE = "complete.json"
_ZERO_SHARD = re.compile(r"zero_pp_rank_(\d+)_mp_rank_\d+_(optim|model)_states\.pt")


def tag_steps(part_dir: str | os.PathLike) -> list[int]:
    """The steps of the tag folders `step<N>` in `part_dir`, newest first."""
    d = Path(part_dir)
    if not d.is_dir():
        return []
    found = (TAG.fullmatch(p.name) for p in d.iterdir() if p.is_dir())
    return sorted((int(m.group(1)) for m in found if m), reverse=True)


def problem(part_dir: str | os.PathLike, tag: str) -> str | None:
    """What is wrong with checkpoint `tag` in `part_dir` (one phrase), or None if it is intact."""
    d = Path(part_dir) / tag
    if not d.is_dir():
        return "missing"
    files = sorted(d.glob("*.pt"))
    if not any(f.name.endswith("model_states.pt") for f in files):
        return "no *model_states.pt file in it"
    for kind in ("optim", "model"):
        ranks = sorted(
            int(m.group(1)) for f in files if (m := _ZERO_SHARD.fullmatch(f.name)) and m[2] == kind
        )
        if ranks and ranks != list(range(ranks[-1] + 1)):
            missing = sorted(set(range(ranks[-1] + 1)) - set(ranks))
            return f"the ZeRO {kind} shard of rank {missing[0]} is missing"
    for f in files:
        why = _file_problem(f)
        if why:
            return f"{f.name} {why}"
    return None


def _file_problem(path: Path) -> str | None:
    try:
        with open(path, "rb") as fh:
            head = fh.read(4)
        if not head:
            return "is empty"
        if head != b"PK\x03\x04":
            # torch's legacy (non-zip) format is a pickle stream, whose first byte is the PROTO opcode
            # 0x80: nothing more to check cheaply. Anything else (e.g. a file overwritten by other
            # bytes) is not a torch checkpoint, and torch.load would fail on it with no path.
            return (
                None
                if head[:1] == b"\x80"
                else "is not a torch checkpoint (neither a zip archive nor a pickle)"
            )
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (OSError, zipfile.BadZipFile, EOFError, ValueError) as e:
        return f"is truncated or corrupted ({' '.join(str(e).split())})"
    return f"is corrupted (its member {bad} fails the CRC check)" if bad else None


def _latest(part_dir: Path) -> str | None:
    try:
        return (part_dir / "latest").read_text().strip() or None
    except OSError:
        return None


def damage(ckpt_dir: str | os.PathLike, tag: str, parts: Sequence[str] = ("policy",)) -> str | None:
    """Why checkpoint `tag` of `ckpt_dir` is damaged ('checkpoint <part folder>/<tag> is damaged: ...',
    naming the file), or None when it is intact in every part. Shared by resume and polgrad.export."""
    ckpt = Path(ckpt_dir)
    why = next(((p, w) for p in parts if (w := problem(ckpt / p, tag))), None)
    return None if why is None else f"checkpoint {ckpt / why[0] / tag} is damaged: {why[1]}"


def newest_intact(ckpt_dir: str | os.PathLike, parts: Sequence[str] = ("policy",)) -> str | None:
    """The newest tag intact in every part of `ckpt_dir`, or None."""
    first = Path(ckpt_dir) / parts[0]
    return next((f"step{s}" for s in tag_steps(first) if damage(ckpt_dir, f"step{s}", parts) is None), None)


def resume_tag(
    ckpt_dir: str | os.PathLike, parts: Sequence[str] = ("policy",), *, warn: bool = True
) -> str | None:
    """The newest tag intact in every part of `ckpt_dir` (e.g. 'step8'), or None if there is no
    checkpoint at all (a fresh start). Prints one `warning:` line per damaged newer tag (when `warn`);
    raises a one-line DataError when checkpoints exist but none is intact."""
    ckpt = Path(ckpt_dir)
    first = ckpt / parts[0]
    latest = _latest(first)
    damaged: list[str] = []
    if latest is not None and not (first / latest).is_dir():
        damaged.append(f"{first / 'latest'} names {latest}, which does not exist")
    for step in tag_steps(first):
        tag = f"step{step}"
        why = damage(ckpt, tag, parts)
        if why is None:
            if warn:
                for d in damaged:
                    print(f"warning: {d}; resuming from the intact {first / tag} instead", file=sys.stderr)
            return tag
        damaged.append(why)
    if not damaged:
        return None
    cell = os.environ.get("POLGRAD_CELL_ID")
    again = (
        f"re-run the sweep with --restart {cell} (it moves the old run folder aside)"
        if cell
        else f"move the run folder {ckpt.parent} aside (or delete it) and run again without --resume, or "
        "choose a new --out"
    )
    raise DataError(f"cannot resume from {ckpt}: no intact checkpoint ({damaged[0]}); to start over, {again}")


# --------------------------------------------------------------------------- a run's checkpoint
def load_part(engine: Any, part_dir: str, tag: str) -> dict[str, Any]:
    """`load_engine` of a checked tag (`resume_tag`); a failure is one line naming the folder."""
    try:
        return load_engine(engine, part_dir, tag=tag)
    except PolgradError:
        raise
    except Exception as e:  # noqa: BLE001 - torch/DeepSpeed errors name neither the file nor the fix
        raise DataError(
            f"cannot load checkpoint {os.path.join(part_dir, tag)}: {type(e).__name__}: {e}; move that "
            "folder aside to resume from the one before it"
        ) from e


def save(
    m: Any, out_dir: str, step: int, client_state: dict[str, Any], *, keep_last: int | None = None
) -> None:
    """The run's checkpoint `step<N>` of every engine (the policy's, a critic's own: `m.critic.engines()`),
    the async sampler's older weights first, then the `complete.json` marker; with `keep_last` = N
    (train.keep_checkpoints) every tag older than the N newest is removed (`prune`), else every
    earlier one is kept to fall back to on resume. `client_state` (the loop state) goes into each.

    Collective: every rank calls it. A write that fails (disk full, read-only folder) is one line
    naming the tag folder; the partial folder is removed, so the run's newest intact checkpoint stays
    the one a resume loads."""
    ckpt, tag = RunFolder(out_dir).checkpoints, f"step{step}"
    # Async rollouts: the older weights the next steps sample with, first.
    m.sampler.save(str(ckpt / "sampler"), step)
    parts = (("policy", m.engine), *m.critic.engines())
    for part, engine in parts:
        try:
            save_engine(engine, ckpt / part, tag, client_state)
        except (OSError, RuntimeError) as e:
            where = os.path.join(ckpt, part, tag)
            shutil.rmtree(where, ignore_errors=True)
            raise _checkpoint_write_error(e, where) from e
    # Written last, once every part's files of every rank are (save_engine ends with a barrier):
    # a copy of the folder made elsewhere (a Ray node's, polgrad/sweep/ray_sync.py) knows from it
    # which tags are whole and which parts a whole one has.
    from polgrad import collective  # here: importing this module needs no torch (the Ray driver reads it)

    if collective.rank() == 0:
        marker = {"step": step, "parts": [part for part, _ in parts]}
        atomic_write_text(ckpt / COMPLETE, json.dumps(marker) + "\n")
    if keep_last is not None:
        collective.all_max(_zero())  # the marker names this step before any rank removes a tag
        prune(ckpt, keep_last, newest=step, parts=[part for part, _ in parts])


def _zero():
    import torch

    return torch.zeros(())


def prune(
    ckpt_dir: str | os.PathLike,
    keep_last: int,
    *,
    newest: int | None = None,
    parts: Sequence[str] | None = None,
) -> list[str]:
    """Remove every tag older than the `keep_last` newest ones present in every part (not newer than
    `newest`: the step just saved by every rank, else complete.json's; `parts`: the parts just saved,
    else the marker's), and the async sampler's files of those steps; returns what was removed.

    At least 2 are kept (train.keep_checkpoints >= 2): the newest may still be on its way to the disk
    or to a cluster's driver, and the one before it is then the checkpoint a resume falls back to.
    Each rank removes what its own file system holds (a cell spanning nodes: its own shards), so a
    cluster's synced copy loses them too (polgrad/sweep/ray_sync.py copies deletions). Without a
    known saved step nothing is removed; a file that cannot be removed stays (an extra checkpoint)."""
    if keep_last < 2:
        raise ConfigError(
            f"train.keep_checkpoints = {keep_last}: keep at least 2 (the newest may not have reached the "
            "disk or the cluster's driver yet; the one before is the fallback), or None to keep all"
        )
    ckpt = Path(ckpt_dir)
    if newest is None or parts is None:
        try:
            marker = json.loads((ckpt / COMPLETE).read_text())
            newest = int(marker["step"]) if newest is None else newest
            parts = list(marker["parts"]) if parts is None else parts
        except (OSError, ValueError, KeyError, TypeError):
            return []
    saved = [ckpt / p for p in parts]
    in_every_part = set.intersection(*({s for s in tag_steps(p) if s <= newest} for p in saved))
    kept = sorted(in_every_part, reverse=True)[:keep_last]
    if len(kept) < keep_last:
        return []
    removed = []
    for folder in [*saved, ckpt / "sampler"]:
        for path in sorted(folder.glob("step*")) if folder.is_dir() else []:
            m = TAG.fullmatch(path.name.removesuffix(".pt"))
            if m and int(m[1]) < kept[-1]:
                try:
                    if path.is_dir():
                        shutil.rmtree(path)
                    else:
                        path.unlink()
                except OSError:  # another rank on the same disk removed it first, or it cannot go
                    pass
                removed.append(str(path))
    return removed


def _checkpoint_write_error(e: BaseException, where: str) -> PolgradError:
    """torch reports a full disk as "PytorchStreamWriter failed writing file ... unexpected pos": name
    the folder and, from the file system, the reason."""
    fix = "free space (or make the folder writable) and re-run with --resume (a sweep: the same command)"
    if isinstance(e, OSError) and is_write_failure(e):
        return write_error(e, where, fix)
    folder = os.path.dirname(where)
    st = os.statvfs(folder) if os.path.isdir(folder) else None
    if st is not None and st.f_bavail * st.f_frsize < 2**20:
        return write_error(OSError(errno.ENOSPC, ""), where, fix)
    if not os.access(folder, os.W_OK):
        return write_error(OSError(errno.EACCES, ""), where, fix)
    if isinstance(e, OSError) or "PytorchStreamWriter" in str(e) or "unexpected pos" in str(e):
        first = " ".join(str(e).split())[:200]
        return WriteError(f"could not write checkpoint {where} ({type(e).__name__}: {first}); {fix}")
    raise e


# --------------------------------------------------------------------------- one engine's checkpoint
_RNG_KEY = "polgrad_rng"  # where save_engine puts every rank's RNG states in client_state


def _rng_state() -> dict[str, Any]:
    import random

    import numpy as np
    import torch

    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        # numpy's array as a list: checkpoints stay loadable with torch.load(weights_only=True)
        "numpy": (np_state[0], np_state[1].tolist(), *np_state[2:]),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    import random

    import numpy as np
    import torch

    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_engine(
    engine: Any,
    dir: str | os.PathLike[str],
    tag: str,
    client_state: Mapping[str, Any] | None = None,
) -> None:
    """DeepSpeed's `engine.save_checkpoint` plus every rank's RNG states (python, numpy, torch).

    Collective: every rank must call it, between optimizer steps. DeepSpeed writes `client_state`
    once (rank 0's copy); the RNG states of all ranks are gathered into it under a private key, so
    that a resume at the same world size continues bit-identically. The `latest` file naming `tag`
    is written by rank 0 once every rank has written its files, atomically (never empty or half).
    """
    import torch.distributed as tdist

    managed = getattr(engine, "_is_gradient_accumulation_boundary", None) is None  # no boundary=
    if managed and engine.micro_steps % engine.gradient_accumulation_steps() != 0:
        raise PolgradError(
            "save_engine: call it between optimizer steps (after the step() that returned True or "
            "False), not in the middle of gradient accumulation"
        )
    states: list[Any] = [None] * tdist.get_world_size()
    tdist.all_gather_object(states, _rng_state())
    state = dict(client_state or {})
    if _RNG_KEY in state:
        raise ConfigError(f"save_engine: client_state key {_RNG_KEY!r} is reserved for RNG states")
    state[_RNG_KEY] = states
    # DeepSpeed writes `latest` with a plain open(); ours is written atomically, after every rank has
    # written its files of the tag (a crash leaves the old `latest` or the new, never an empty one).
    engine.save_checkpoint(str(dir), tag=tag, client_state=state, save_latest=False)
    if tdist.get_rank() == 0:
        atomic_write_text(Path(dir) / "latest", tag)
    tdist.barrier()


def has_engine_checkpoint(dir: str | os.PathLike[str]) -> bool:
    """True if `dir` holds a checkpoint that `load_engine(engine, dir)` would load."""
    return (Path(dir) / "latest").is_file()


def load_engine(engine: Any, dir: str | os.PathLike[str], tag: str | None = None) -> dict[str, Any]:
    """Load a `save_engine` checkpoint (the `latest` tag unless `tag`); return its client_state.

    Restores module, optimizer and engine counters (DeepSpeed) and this rank's RNG states. At a
    different world size the RNG states of the saving ranks do not map onto this one's and are
    left untouched (training resumes, but not bit-identically).
    """
    path = Path(dir)
    if tag is None and not has_engine_checkpoint(path):
        raise DataError(f"load_engine: no checkpoint in {path} (no 'latest' file); save one or pass tag=")
    load_path, client_state = engine.load_checkpoint(str(path), tag=tag)
    if load_path is None:
        raise DataError(f"load_engine: could not load tag {tag!r} from {path}")
    client_state = dict(client_state or {})
    states = client_state.pop(_RNG_KEY, None)
    import torch.distributed as tdist

    if states is not None and len(states) == tdist.get_world_size():
        _set_rng_state(states[tdist.get_rank()])
    return client_state
