"""Which outcome metrics a built cell records, and the refusal of a prediction its runs cannot decide.

A prediction is judged on the paired values of one metric in its configuration's runs and the
baseline's (polgrad/results/predictions.py). A metric some of those runs never record (a reward
model's gold, `final_gold_reward`, on a sweep trained on the task's reward) leaves it undecided after
the whole sweep has trained, with no word why; the dry run (and so every real sweep, before any cell)
refuses it instead, from what each built cell records (`recorded`, which follows what
polgrad/trainer.py and polgrad/offline.py log and polgrad/summary.py summarises):

- a reward model's columns (`REWARD_MODEL_COLUMNS`) only with train.reward_source = 'reward_model';
  its held-out accuracy also when a part reads a reward model (`needs_reward_model`);
- a preference spec (DPO: `Algorithm.offline`) samples nothing: no train reward, KL, entropy, response
  lengths or reward-model accuracy per step;
- the KL columns only with a reference: a KL term, or train.measure_kl (the default).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from polgrad.errors import ConfigError
from polgrad.results.store import LENGTH_COLUMNS, OUTCOME_METRICS, REWARD_MODEL_COLUMNS
from polgrad.sweep.experiment import Experiment

_GOLD = ("final_gold_reward", "eval_rm_score", "eval_rm_score_init")
_SAMPLED = ("final_train_reward", "kl", "kl_exact", "entropy", *LENGTH_COLUMNS)


def recorded(cfg: Any, algo: Any) -> tuple[str, ...]:
    """The OUTCOME_METRICS the run of a built cell (its TrainConfig and Algorithm) records."""
    absent: set[str] = set()
    if cfg.reward_source != "reward_model":
        absent.update(_GOLD)
        if not algo.needs_reward_model:
            absent.add("rm_heldout_accuracy")
    if algo.offline:
        absent.update((*_SAMPLED, "final_gold_reward", "rm_heldout_accuracy"))
    elif not (algo.needs_reference or cfg.measure_kl):
        absent.update(("kl", "kl_exact"))
    return tuple(m for m in OUTCOME_METRICS if m not in absent)


def _compares(cell: Any, config: dict[str, str]) -> bool:
    """Whether `cell` is a run of `config` ({'spec': stem, binding: value text}: a prediction's)."""
    swept = dict(cell.swept)
    return all(cell.spec_name == v if k == "spec" else swept.get(k) == v for k, v in config.items())


def check_predictions(exp: Experiment, cells: Sequence[Any], records: dict[str, Sequence[str]]) -> None:
    """One ConfigError line for the first prediction whose metric some run it compares (its
    configuration's or the baseline's) does not record; `records` maps a cell id to `recorded`."""
    where = f"line {exp.lines['predictions']}: Sweep.predictions" if "predictions" in exp.lines else ""
    for i, p in enumerate(exp.predictions):
        runs = [
            c for c in cells if c.id in records and (_compares(c, p["config"]) or _compares(c, exp.baseline))
        ]
        lacking = [c for c in runs if p["metric"] not in records[c.id]]
        if not lacking:
            continue
        common = [m for m in OUTCOME_METRICS if all(m in records[c.id] for c in runs)]
        which = "none" if len(lacking) == len(runs) else f"{len(lacking)} (e.g. cell {lacking[0].id})"
        raise ConfigError(
            f"{exp.file}: {where or 'Sweep.predictions'}[{i}] ({p['claim']!r}): its metric {p['metric']} is "
            f"recorded by {which} of the {len(runs)} runs it compares, so it could never be decided; "
            f"they record {', '.join(common)}: predict one of those, or train with what records it"
            + (" (train.reward_source = 'reward_model')" if p["metric"] in REWARD_MODEL_COLUMNS else "")
        )
