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
(`polgrad.distributed.save_checkpoint`) atomically, once every file of the tag is written.
"""

from __future__ import annotations

import os
import re
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path

from polgrad.errors import DataError

TAG = re.compile(r"step(\d+)")
# checkpoints/complete.json: {"step": N, "parts": [...]} of the newest checkpoint whose every part (and
# every rank's files) is written; rank 0 writes it last (polgrad/loop_state.py save_checkpoint).
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
