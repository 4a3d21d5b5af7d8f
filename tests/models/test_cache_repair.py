"""A broken warm-start / reward-model cache entry is rebuilt, not trusted (polgrad/models/cache.py).

A weights file deleted or truncated after the entry was made used to count as a hit: every run on it
failed while loading, and the entry was never rebuilt. `cache_entry` now checks a hit first
(`entry_problem`: the sizes polgrad.json records, config.json, the safetensors headers), and rebuilds
a broken one under the key's lock with one line on stderr. The entries here are small stand-ins
(a config.json, one safetensors file, polgrad.json) made through `cache_entry` itself: what is
checked is the cache, not the training that fills it (tests/models/test_models.py).
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import save_file

from polgrad.models.cache import POLGRAD_JSON, cache_entry, entry_problem, read_info


def _fill(tmp, value: float = 1.0) -> None:
    """What a warm start writes into its tmp dir: config, weights, tokenizer and polgrad.json."""
    (tmp / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    save_file({"w": torch.full((64, 64), value)}, str(tmp / "model.safetensors"))
    (tmp / "tokenizer.json").write_text('{"version": "1.0"}')
    (tmp / POLGRAD_JSON).write_text(json.dumps({"key": "k", "stats": {"value": value}}))


def _make(root, name: str = "add-0123", value: float = 1.0):
    with cache_entry(root, name) as (final, tmp):
        assert tmp is not None
        _fill(tmp, value)
    return final


def _hit(root, name: str = "add-0123") -> bool:
    """Whether the key is a hit now (a miss is filled again, as a warm start would)."""
    with cache_entry(root, name) as (final, tmp):
        if tmp is not None:
            _fill(tmp, 2.0)
    return tmp is None


def test_a_whole_entry_is_a_hit_and_records_its_files_sizes(tmp_path):
    final = _make(tmp_path)
    files = read_info(final)["files"]
    assert files == {
        f: (final / f).stat().st_size for f in ("config.json", "model.safetensors", "tokenizer.json")
    }
    assert entry_problem(final) is None
    assert _hit(tmp_path)
    assert read_info(final)["stats"]["value"] == 1.0  # the entry made first, untouched


@pytest.mark.parametrize(
    "damage, problem",
    [
        (lambda f: f.unlink(), "model.safetensors is missing"),
        (lambda f: f.write_bytes(f.read_bytes()[:100]), "model.safetensors is 100 bytes, 16,.* when made"),
    ],
    ids=["deleted", "truncated"],
)
def test_a_deleted_or_truncated_weights_file_is_rebuilt_with_one_line(tmp_path, capsys, damage, problem):
    final = _make(tmp_path)
    damage(final / "model.safetensors")
    assert not _hit(tmp_path)  # rebuilt, not trusted
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"warning: cache entry {final} is broken (" in err and "); rebuilding it" in err, err
    assert re.search(problem, err), err
    assert entry_problem(final) is None and read_info(final)["stats"]["value"] == 2.0
    assert _hit(tmp_path)  # and trusted again once rebuilt
    assert capsys.readouterr().err == ""


def test_an_entry_made_before_sizes_were_recorded_is_checked_by_its_safetensors_header(tmp_path):
    final = _make(tmp_path)
    info = read_info(final)
    del info["files"]
    (final / POLGRAD_JSON).write_text(json.dumps(info))
    assert entry_problem(final) is None  # an older whole entry stays a hit
    weights = final / "model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[:-1])
    assert entry_problem(final) == f"model.safetensors is {size - 1:,} bytes, its header says {size:,}"
    weights.write_bytes(b"\x00" * 3)
    assert entry_problem(final) == "model.safetensors has no readable header (3 bytes)"
    weights.unlink()
    assert entry_problem(final) == "no weights file"
    (final / "config.json").write_text("{half")
    assert entry_problem(final) == "no readable config.json"
    (final / POLGRAD_JSON).write_text("{half")
    assert entry_problem(final) == f"no readable {POLGRAD_JSON}"
    assert not _hit(tmp_path) and entry_problem(final) is None
