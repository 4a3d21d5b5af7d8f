"""Study plug-ins: the analyses of particular experiments, which live outside the library and plug into
its sweep and report.

polgrad's sweep and report are generic: a leaderboard, paired statistics, predictions, figures. An
analysis that only some experiments need (a replication set beside its original, the over-optimisation
fits of Gao et al.) is a study: a module outside the `polgrad` package (this repository's are in
studies/) with a module-level `STUDY = Study(...)`. An experiment names the studies it uses,

    Sweep.studies = ['studies.replication']

the dry run imports each (a name that does not import, or a module without a Study, is one line
naming the file and the binding), the sweep records the names in results/<name>/experiment.json,
and every report of the experiment imports them again from there. The library never imports a study
by name in its code (tests/project/test_layers.py checks it); a study may use anything of the library.

A study contributes, each optional:

    outputs   suffixes of files it writes in the experiment's folder (results/<name>/<name><suffix>;
              like everything in that folder, the provenance check ignores them)
    answers   suffixes of its own mds (results/<name>/<name><suffix>.md) whose "**Answer.**" line the
              experiment's md quotes after its own answer
    section   section(experiment, results_dir) -> lines: a section the experiment's md gets before
              its findings ([] for none); its last line, a one-sentence summary, also opens the
              findings as "- <title>: <summary>"
    answer    answer(experiment, answer, section) -> the experiment's answer given the section
              (None leaves it as it is)

A study module imports from the working directory or PYTHONPATH, else from the repository that holds
the experiment file (or the results folder).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from polgrad.errors import ConfigError

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


@dataclasses.dataclass(frozen=True)
class Study:
    """What one study adds to its experiments' reports (see the module docstring)."""

    title: str
    outputs: tuple[str, ...] = ()
    answers: tuple[str, ...] = ()
    section: Callable[[str, Any], list[str]] | None = None
    answer: Callable[[str, str, list[str]], str | None] | None = None


Root = str | os.PathLike | Callable[[], str | os.PathLike | None] | None


def load(names: Sequence[str], where: str, root: Root = None) -> list[Study]:
    """The Study of each module in `names`, imported; a one-line ConfigError naming `where` otherwise.

    A name that does not import from the working directory or PYTHONPATH is looked for again under
    `root` (the repository of the experiment file or results folder, or a function giving it, called
    only then: a sweep started from another directory finds the repository's studies/ as it finds its
    specs)."""
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise ConfigError(f"{where}: a list of study modules, e.g. ['studies.replication'], got {names!r}")
    studies = []
    for name in names:
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ConfigError(f"{where}: {name!r} is not a module name (e.g. 'studies.replication')")
        module = _import(name, where, root)
        study = getattr(module, "STUDY", None)
        if not isinstance(study, Study):
            raise ConfigError(
                f"{where}: module '{name}' is not a study: it needs a module-level STUDY = "
                "polgrad.results.studies.Study(...)"
            )
        studies.append(study)
    return studies


def _import(name: str, where: str, root: Root):
    top = name.split(".")[0]
    for attempt in range(2):
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as e:
            missing = e.name or ""
            if missing != name and not name.startswith(missing + "."):  # the study imports, its import fails
                raise ConfigError(f"{where}: study '{name}' failed to import: {e}") from None
            root = root() if callable(root) else root
            if attempt or root is None or not (Path(root) / top).exists() or str(root) in sys.path:
                raise ConfigError(
                    f"{where}: study '{name}' does not import ({e}); run from the repository that holds "
                    "it, or put that folder on PYTHONPATH"
                ) from None
            sys.path.append(str(root))
        except Exception as e:  # a study that raises on import: its error, in one line
            raise ConfigError(f"{where}: study '{name}' failed to import: {type(e).__name__}: {e}") from None
    raise AssertionError("unreachable")
