"""Output folders are all or nothing (final/, `python -m polgrad.export`, RUN_DIR/model/, a checkpoint's
`latest`), and the export checks its checkpoint with resume's check (polgrad/checkpoints.py).

A run folder here is built by hand from tiny files: RUN_DIR/model/policy (a 1-layer Qwen2 config and
the character tokenizer) and DeepSpeed-style stage-0 checkpoints `checkpoints/policy/step<N>/
mp_rank_00_model_states.pt` ({"module": state dict}), the files polgrad.export reads.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest
import torch

from polgrad import export
from polgrad.critic import NoCritic
from polgrad.errors import WriteError
from polgrad.io import atomic_dir
from polgrad.layout import FullCopies

REPO = Path(__file__).resolve().parents[2]
MODEL = "mp_rank_00_model_states.pt"


def _tiny():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from polgrad.models.tokenizer import build_tokenizer

    tok = build_tokenizer("0123456789+=")
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        intermediate_size=32,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg), tok


def _weights_at(model, step: int) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() + step for k, v in model.state_dict().items()}


def fake_run(run: Path, steps=(1, 2)) -> dict[int, dict[str, torch.Tensor]]:
    """A run folder polgrad.export can read; returns the policy weights saved at each step."""
    model, tok = _tiny()
    (run / "model" / "policy").mkdir(parents=True)
    model.config.save_pretrained(run / "model" / "policy")
    tok.save_pretrained(run / "model" / "policy")
    saved = {}
    for s in steps:
        d = run / "checkpoints" / "policy" / f"step{s}"
        d.mkdir(parents=True)
        saved[s] = _weights_at(model, s)
        torch.save({"module": saved[s]}, d / MODEL)
    (run / "checkpoints" / "policy" / "latest").write_text(f"step{steps[-1]}")
    return saved


def loads_as_model(path: Path) -> bool:
    from transformers import AutoModelForCausalLM

    try:
        AutoModelForCausalLM.from_pretrained(path)
    except (OSError, ValueError):
        return False
    return True


def _assert_weights(path: Path, expected: dict[str, torch.Tensor]) -> None:
    from transformers import AutoModelForCausalLM

    got = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    assert set(got) == set(expected)
    for k, v in expected.items():
        assert torch.equal(got[k], v), k


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


# ----------------------------------------------------------------------------- export: bad input
def test_export_of_a_truncated_checkpoint_names_the_file_and_the_intact_step(tmp_path, capsys):
    run = tmp_path / "run"
    fake_run(run)
    bad = run / "checkpoints" / "policy" / "step2" / MODEL
    bad.write_bytes(bad.read_bytes()[:100])
    assert export.main([str(run)]) == 2
    err = one_line(capsys)
    assert f"checkpoint {run / 'checkpoints' / 'policy' / 'step2'} is damaged: {MODEL} is truncated" in err
    assert f"export the intact step1 instead: python -m polgrad.export {run} --step 1" in err
    assert not (run / "export-step2").exists()
    assert export.main([str(run), "--step", "2"]) == 2  # asked for by step: the same check
    assert f"{MODEL} is truncated" in one_line(capsys)


def test_export_with_no_intact_checkpoint_says_so(tmp_path, capsys):
    run = tmp_path / "run"
    fake_run(run, steps=(1,))
    (run / "checkpoints" / "policy" / "step1" / MODEL).write_bytes(b"")
    assert export.main([str(run)]) == 2
    err = one_line(capsys)
    assert f"{MODEL} is empty; no intact checkpoint is left to export" in err


def test_export_of_a_folder_that_is_no_run_names_it(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert export.main([str(empty)]) == 2
    err = one_line(capsys)
    assert f"{empty}: not a polgrad run folder (no checkpoints/ or summary.json)" in err
    assert "predates" not in err
    assert export.main([str(tmp_path / "nowhere")]) == 2
    assert f"{tmp_path / 'nowhere'}: no such folder" in one_line(capsys)


# ----------------------------------------------------------------------------- export: all or nothing
_CHILD = textwrap.dedent(
    """
    import sys, time, pathlib
    from polgrad import export

    def stall(*args, **kwargs):  # weights, config and tokenizer are written; the card is next
        pathlib.Path(sys.argv[3]).write_text("mid-write")
        time.sleep(120)

    export.model_card = stall
    export.main([sys.argv[1], "--step", "2", "--out", sys.argv[2]])
    """
)


def _kill_mid_export(run: Path, dest: Path, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", str(REPO))}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(run), str(dest), str(marker)], env=env)
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert child.poll() is None, "the export ended before it was killed"
            assert time.monotonic() < deadline, "the export never reached its last file"
            time.sleep(0.1)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()


def test_kill_9_during_export_leaves_no_folder_that_loads_as_a_model(tmp_path):
    run = tmp_path / "run"
    saved = fake_run(run)
    dest = tmp_path / "out" / "final"
    _kill_mid_export(run, dest, tmp_path)
    assert not dest.exists()
    leftovers = [p for p in dest.parent.iterdir() if p.is_dir()]
    assert all(p.name.startswith("final.tmp-") for p in leftovers), leftovers  # named as temp, not final
    # a later export writes the whole folder and removes the dead writer's temp folder
    assert export.main([str(run), "--step", "2", "--out", str(dest)]) == 0
    assert sorted(p.name for p in dest.parent.iterdir()) == ["final"]
    _assert_weights(dest, saved[2])
    assert (dest / "README.md").is_file() and (dest / "tokenizer_config.json").is_file()


def test_kill_9_during_a_re_export_keeps_the_old_folder_whole(tmp_path):
    run = tmp_path / "run"
    saved = fake_run(run)
    dest = tmp_path / "export"
    assert export.main([str(run), "--step", "1", "--out", str(dest)]) == 0
    _kill_mid_export(run, dest, tmp_path)  # re-export of step 2 over it, killed
    _assert_weights(dest, saved[1])
    assert (dest / "README.md").read_text().count("- step: 1") == 1
    assert export.main([str(run), "--step", "2", "--out", str(dest)]) == 0  # swapped in whole
    _assert_weights(dest, saved[2])
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("export")) == ["export"]


def test_export_never_replaces_a_folder_that_is_not_an_export(tmp_path, capsys):
    """An export replaces its destination whole, so `--out` naming the run folder itself, or any
    folder holding other files, is refused in one line and left untouched (it used to be swapped
    out and deleted, checkpoints included); an empty folder or an earlier export is replaced."""
    run = tmp_path / "run"
    fake_run(run)
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    assert export.main([str(run), "--out", str(run)]) == 2
    assert f"--out {run}: the folder exists and is not a polgrad export" in one_line(capsys)
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert export.main([str(run), "--out", str(mine)]) == 2
    assert "choose a new or empty --out" in one_line(capsys)
    assert (mine / "notes.txt").read_text() == "keep me"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert export.main([str(run), "--out", str(empty)]) == 0 and loads_as_model(empty)
    assert export.main([str(run), "--step", "1", "--out", str(empty)]) == 0  # an earlier export
    assert (empty / "README.md").read_text().count("- step: 1") == 1


# ----------------------------------------------------------------------------- final/ and model/
def _fake_models(model, tok):
    """What write_final reads of a run's models: a plain (non-LoRA) policy engine, no critic."""
    engine = types.SimpleNamespace(module=model)
    return types.SimpleNamespace(engine=engine, critic=NoCritic(), tokenizer=tok, layout=FullCopies())


def test_a_write_final_that_fails_midway_leaves_the_old_final_and_no_half_one(tmp_path, monkeypatch):
    model, tok = _tiny()
    m = _fake_models(model, tok)
    kw = dict(name="grpo", source="s", config="", summary={"steps": 2})
    final = export.write_final(m, str(tmp_path), **kw)
    assert final == tmp_path / "final" and loads_as_model(final)
    before = {p.name: p.read_bytes() for p in final.iterdir() if p.is_file()}

    def disk_full(*args, **kwargs):  # after the weights are written: the tokenizer's save fails
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tok, "save_pretrained", disk_full)
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(1.0)
    with pytest.raises(WriteError, match="final"):
        export.write_final(m, str(tmp_path), **kw)
    assert {p.name: p.read_bytes() for p in final.iterdir() if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]  # no temp folder left

    fresh = tmp_path / "fresh"
    with pytest.raises(WriteError):
        export.write_final(m, str(fresh), **kw)
    assert not (fresh / "final").exists()


def test_atomic_dir_swaps_a_folder_and_removes_only_dead_writers_leftovers(tmp_path):
    dest = tmp_path / "final"
    with atomic_dir(dest) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith("final.tmp-") and not dest.exists()
        (tmp / "a").write_text("1")
    assert (dest / "a").read_text() == "1"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    pid = int(dead.stdout)
    stale, live = tmp_path / f"final.tmp-{pid}-x", tmp_path / f"final.tmp-{os.getppid()}-y"
    aside = tmp_path / f"final.old-{pid}-z"
    for d in (stale, live, aside):
        d.mkdir()
    other = tmp_path / "finalist.tmp-1-x"  # another folder's name: never touched
    other.mkdir()
    with atomic_dir(dest) as tmp:
        (tmp / "b").write_text("2")
    assert sorted(p.name for p in dest.iterdir()) == ["b"]
    assert not stale.exists() and not aside.exists()
    assert live.exists() and other.exists()  # a live writer's temp folder is its own


def test_a_writer_killed_between_the_renames_of_a_swap_gets_its_old_folder_back(tmp_path):
    """The one window of a swap: the old folder renamed aside, the new one not yet in. The next
    write of the folder puts the old one back before it starts, so a write that then fails leaves
    the folder as it was."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    dest, aside = tmp_path / "final", tmp_path / f"final.old-{int(dead.stdout)}-z"
    aside.mkdir()
    (aside / "a").write_text("old")
    with pytest.raises(RuntimeError), atomic_dir(dest) as tmp:
        (tmp / "b").write_text("half")
        raise RuntimeError("the next writer fails too")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    assert (dest / "a").read_text() == "old"


def test_latest_is_renamed_into_place_after_the_tag(tmp_path, monkeypatch):
    """DeepSpeed writes `latest` with a plain open(); polgrad writes it atomically (os.replace),
    when every file of the tag is on disk."""
    from polgrad import checkpoints, distributed, io

    distributed.setup(seed=0)
    engine = distributed.make_engine(
        torch.nn.Linear(4, 4),
        lr=1e-2,
        weight_decay=0.0,
        zero_stage=0,
        micro_batch_size=1,
        grad_accum=1,
        bf16=False,
        grad_clip=None,
    )
    renamed = []
    real = io.os.replace

    def spy(src, dst):
        if Path(dst).name == "latest":
            renamed.append((Path(dst), sorted(p.name for p in (Path(dst).parent / "step3").iterdir())))
        return real(src, dst)

    monkeypatch.setattr(io.os, "replace", spy)
    checkpoints.save_engine(engine, tmp_path, "step3", {"step": 3})
    assert renamed == [(tmp_path / "latest", [MODEL])]  # once, by rename, after the tag's file
    assert (tmp_path / "latest").read_text() == "step3"
