"""A sweep cell's run folder between a Ray node and the driver (polgrad/sweep/ray_cells.py runs the
cells): a folder's files as {relative path: bytes} (`read_tree`, `write_tree`), what changed in it
since the last look (`Mirror`), the names a rank above 0 sends its files under (`rank_name`,
`rank_snapshot`), and the checkpoints a restarted cell may resume from (`usable_checkpoints`).
Pure file work: nothing here imports Ray."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from polgrad import run_folder
from polgrad.errors import PolgradError
from polgrad.run_folder import RunFolder

# The driver's record of a cell's attempts (node, start, end, how each ended); the driver's own.
ATTEMPTS = "ray_attempts.jsonl"
# The driver's record of what the cell's tasks wrote on their nodes (their output, Ray's warnings).
NODE_LOG = "ray_node.log"
# Never copied between nodes: the trainer's lock and pid are facts of one machine's processes; the
# driver's two records are the driver's.
NOT_SYNCED = frozenset({run_folder.LOCK, "trainer.pid", ATTEMPTS, NODE_LOG})


# --------------------------------------------------------------------------------------------
# A folder's files as {relative path: bytes}, and what changed since the last look
# --------------------------------------------------------------------------------------------


def _transient(part: str) -> bool:
    """A file or folder name that is written to be renamed or set aside (atomic writes' temp files
    and folders, `.old-<time>` and `.incomplete-<n>` folders set aside): never synced, or it would be
    sent, deleted and sent again (or sent to every node at every restart)."""
    return part.endswith(".tmp") or ".tmp-" in part or ".old-" in part or ".incomplete-" in part


def _files(root: Path) -> Iterator[tuple[str, Path]]:
    for dirpath, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not _transient(d)]
        for name in names:
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if name not in NOT_SYNCED and not _transient(name):
                yield rel, path


def read_tree(root: Path) -> dict[str, bytes]:
    """Every file under `root` (but those never synced) as {relative path: bytes}; {} if no folder."""
    out = {}
    if root.is_dir():
        for rel, path in _files(root):
            try:
                out[rel] = path.read_bytes()
            except OSError:  # deleted meanwhile
                pass
    return out


class Mirror:
    """What changed under `root` since the previous `delta()`: (files written, with their bytes;
    files deleted), each under the name `name(rel)` gives it on the driver (None: not sent). A file is
    sent again whenever its size or modification time changes, so a file read while being written is
    sent whole once it is done."""

    def __init__(self, root: Path, known: Iterable[str] = (), name: Callable[[str], str | None] = str):
        self.root, self.name = root, name
        self.seen: dict[str, tuple[int, int]] = {}
        for rel in known:  # what the driver already has: its stat here, after write_tree
            try:
                st = (root / rel).stat()
                self.seen[rel] = (st.st_size, st.st_mtime_ns)
            except OSError:
                pass

    def delta(self) -> tuple[dict[str, bytes], list[str]]:
        now: dict[str, tuple[int, int]] = {}
        changed: dict[str, bytes] = {}
        if not self.root.is_dir():  # the folder itself gone (a wiped disk): that is no deletion to copy
            return {}, []
        for rel, path in _files(self.root):
            if self.name(rel) is None:
                continue
            try:
                st = path.stat()
                key = (st.st_size, st.st_mtime_ns)
                if self.seen.get(rel) != key:
                    changed[self.name(rel)] = path.read_bytes()
                now[rel] = key
            except OSError:  # deleted between the walk and the read: gone
                pass
        deleted = sorted(self.name(rel) for rel in set(self.seen) - set(now) if self.name(rel) is not None)
        self.seen = now
        return changed, deleted


def rank_name(rank: int) -> Callable[[str], str | None]:
    """Local file name -> the driver's, for the files of a rank > 0 of a cell spanning nodes: its
    checkpoint files (its shards) as they are, its log and cell.json as `stdout.rank<r>.log` and
    `cell.rank<r>.json`; rank 0 writes everything else (metrics, summary)."""
    own = {"stdout.log": f"stdout.rank{rank}.log", "cell.json": f"cell.rank{rank}.json"}

    def name(rel: str) -> str | None:
        return own.get(rel, rel if rel.startswith(run_folder.CHECKPOINTS + "/") else None)

    return name


def rank_snapshot(snapshot: dict[str, bytes], rank: int) -> dict[str, bytes]:
    """The driver's copy of a cell's folder as rank `rank` starts from it (its own log and cell.json
    under their local names; rank 0 gets the folder as it is, without the other ranks' logs)."""
    ours = {f"stdout.rank{rank}.log": "stdout.log", f"cell.rank{rank}.json": "cell.json"} if rank else {}
    out = {}
    for rel, data in snapshot.items():
        if rel in ours:
            out[ours[rel]] = data
        elif not rel.startswith(("stdout.rank", "cell.rank")) and not (
            rank and rel in ("stdout.log", "cell.json")
        ):
            out[rel] = data
    return out


def _inside(root: Path, rel: str) -> Path:
    path = (root / rel).resolve()
    if not path.is_relative_to(root.resolve()):
        raise PolgradError(f"{root}: a synced file's path {rel!r} leaves the run folder")
    return path


def write_tree(root: Path, files: dict[str, bytes], deleted: list[str] = ()) -> None:
    """Write `files` under `root` (each atomically: a reader never sees half a file) and delete
    `deleted` (missing ones are fine)."""
    root.mkdir(parents=True, exist_ok=True)
    for rel, data in files.items():
        path = _inside(root, rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    top = root.resolve()
    for rel in deleted:
        path = _inside(root, rel)
        path.unlink(missing_ok=True)
        # an emptied folder goes too: an empty checkpoint tag would read as a damaged one
        parent = path.parent
        while parent != top and parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()
            parent = parent.parent


def usable_checkpoints(run_dir: Path, world: int) -> list[str]:
    """Before a cell starts again from the driver's copy: set aside (rename `<tag>.incomplete-<n>`) every
    checkpoint tag that is not whole there (a copy cut short by the loss of its node: ranks and parts
    stream their files independently), and the whole `checkpoints` folder when no whole tag is left
    (the cell then starts afresh instead of failing to resume). Nothing is deleted. A tag is whole
    when it is not newer than `checkpoints/complete.json` (written last by the trainer: the newest tag
    of which every part and rank is written), exists in each part that marker names, passes the
    integrity check (polgrad/checkpoints.py) and has the ZeRO shard of each of the `world` ranks.
    Without the marker (a run from before it), the parts are the folders present and no tag is
    trusted beyond its part's `latest`. Returns what was set aside."""
    import json

    from polgrad import checkpoints as ck

    ckpt = RunFolder(run_dir).checkpoints
    if not ckpt.is_dir():
        return []
    try:
        marker = json.loads((ckpt / ck.COMPLETE).read_text())
        newest, names = int(marker["step"]), list(marker["parts"])
    except (OSError, ValueError, KeyError, TypeError):
        newest, names = None, [p.name for p in sorted(ckpt.iterdir()) if p.is_dir() and ck.tag_steps(p)]
    parts = [ckpt / n for n in names]
    moved: list[str] = []

    def aside(path: Path) -> None:
        n = 1
        while path.with_name(f"{path.name}.incomplete-{n}").exists():
            n += 1
        path.rename(path.with_name(f"{path.name}.incomplete-{n}"))
        moved.append(str(path))

    def whole(step: int) -> bool:
        tag = f"step{step}"
        for p in parts:
            latest = ck.TAG.fullmatch(_read(p / "latest"))
            limit = newest if newest is not None else (int(latest[1]) if latest else -1)
            if step > limit or not (p / tag).is_dir() or ck.problem(p, tag) or _missing_shard(p / tag, world):
                return False
        return True

    present = [p for p in sorted(ckpt.iterdir()) if p.is_dir() and ck.tag_steps(p)]
    for step in sorted({t for p in present for t in ck.tag_steps(p)}):
        if not whole(step):
            for p in present:
                if (p / f"step{step}").is_dir():
                    aside(p / f"step{step}")
    if not any(ck.tag_steps(p) for p in present):
        if present or (ckpt / ck.COMPLETE).exists():
            aside(ckpt)
    return moved


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _missing_shard(tag_dir: Path, world: int) -> bool:
    """True when the tag has ZeRO shard files of some kind but not one for each of `world` ranks."""
    import re

    kinds: dict[str, set[int]] = {}
    for f in tag_dir.glob("zero_pp_rank_*_states.pt"):
        m = re.fullmatch(r"zero_pp_rank_(\d+)_mp_rank_\d+_(optim|model)_states\.pt", f.name)
        if m:
            kinds.setdefault(m[2], set()).add(int(m[1]))
    return any(ranks != set(range(world)) for ranks in kinds.values())
