"""`python -m polgrad.sweep experiments/X.gin`: expand a grid, validate it, run every cell, rank them.

## The experiment file

An experiment is one gin file. Ordinary gin lines say what *every* cell trains with (`include`
the base config, `import` a user's module, fixed bindings); lines on the configurable `Sweep`
say what varies. Grid values are real gin values: `@kl.k3` is a reference, `'loss'` a string.

    # experiments/kl_ablation.gin: which KL estimator, and where the penalty goes.
    include 'experiments/base_tiny.gin'      # the base config of every cell
    import my_project.parts                  # optional: a user's own registered parts
    train.steps = 200                        # fixed bindings, in every cell

    Sweep.name = 'kl_ablation'               # results/kl_ablation/; default: the file's stem
    Sweep.specs = ['registry/grpo.gin', 'registry/rloo.gin']     # algorithms to compare
    Sweep.grid = {
        'Algorithm.kl': [@kl.k1, @kl.k2, @kl.k3, @kl.abs],       # a component choice
        'Algorithm.kl_placement': ['reward', 'loss'],            # any binding, any gin value
        ('clip.ppo.eps_low', 'clip.ppo.eps_high'): [(0.2, 0.2), (0.2, 0.28)],  # zipped: varied together
    }
    Sweep.seeds = [0, 1, 2]
    Sweep.budget = ('sampled_sequences', 64) # what every cell gets equally (polgrad/sweep/budget.py)
    Sweep.primary_metric = 'eval_accuracy'   # the leaderboard's sort key

That is 2 specs × 4 × 2 × 2 grid points × 3 seeds = 96 cells. `Sweep` parameters:

| parameter            | default           | meaning                                                |
|----------------------|-------------------|--------------------------------------------------------|
| `name`               | file stem         | its folder results/<name>/ (csv, md, figures, runs)    |
| `specs`              | required          | spec gin files (registry/*.gin) to compare             |
| `grid`               | `{}`              | axis -> list of values; an axis is a binding, a macro  |
|                      |                   | name, or a tuple of bindings varied together (zipped)  |
| `seeds`              | required          | list of ints; each cell binds `<seed_binding> = seed`  |
| `seed_binding`       | `'train.seed'`    | the binding that carries the seed                      |
| `primary_metric`     | `'eval_accuracy'` | a summary.json metric; sorts the leaderboard           |
| `higher_is_better`   | `True`            | direction of the primary metric                        |
| `num_cpus`           | `1`               | CPUs per cell (Ray request; threads per cell on Ray)   |
| `num_gpus`           | `0`               | GPUs per cell (Ray request; local GPU slots; 1/k packs |
|                      |                   | k cells on one GPU)                                    |
| `launcher`           | `'deepspeed'`     | cells of several ranks: 'deepspeed' or 'torchrun'      |
| `processes_per_cell` | `1`               | data-parallel ranks (trainer processes, gloo) per CPU  |
|                      |                   | cell (`num_gpus = 0`), started by `launcher` when > 1; |
|                      |                   | a GPU cell runs one rank per GPU of its slot           |
| `placement`          | `'PACK'`          | `--executor ray`: how a cell's ranks go onto nodes,    |
|                      |                   | a placement group of one bundle per rank: 'PACK',      |
|                      |                   | 'SPREAD', 'STRICT_PACK' or 'STRICT_SPREAD'             |
| `ray`                | `{}`              | `--executor ray`: {'sync_s': 1.0, 'retries': 3,        |
|                      |                   | 'grace_s': 60.0}, any of them (ray_checks.RaySettings) |
| `timeout_s`          | `None`            | wall-clock limit per cell; over it: killed, failed,    |
|                      |                   | "timed out after N s" in the CSV and its stdout.log    |
| `question`           | `''`              | the question the experiment answers (heads its md)     |
| `baseline`           | first values      | {column: value} naming the configuration every other   |
|                      |                   | one is compared with, paired by seed ('spec' or a      |
|                      |                   | swept binding as column)                               |
| `predictions`        | `[]`              | [(claim, {column: value}, metric, 'lower' | 'higher' | |
|                      |                   | 'no difference' [, margin])]: statements about a       |
|                      |                   | configuration − the baseline, each marked confirmed /  |
|                      |                   | refuted / undecided by the paired statistics; 'no      |
|                      |                   | difference' needs a margin to be confirmed (an         |
|                      |                   | equivalence test within ±margin)                       |
| `tuning`             | `None`            | {'seeds': [ints], 'grid': {axis: values}[, 'metric':   |
|                      |                   | m, 'higher_is_better': b, 'at_edge': why]}: a tuning   |
|                      |                   | stage run first (see "Tuning stage" below)             |
| `tuned_by`           | `None`            | another experiment's name: bind the values its tuning  |
|                      |                   | stage chose, not re-tuned (a replication; "Tuning      |
|                      |                   | stage" below)                                          |
| `budget`             | `None`            | (unit, value per step): what every cell gets equally,  |
|                      |                   | 'sampled_sequences', 'generated_tokens' (each sets the |
|                      |                   | cells' prompts per step and stop) or 'optimizer_steps' |
|                      |                   | (value = train.steps, checked); polgrad/sweep/budget.py|
| `studies`            | `[]`              | study plug-ins, by module name (e.g.                   |
|                      |                   | 'studies.replication'): analyses the report adds       |
|                      |                   | (polgrad/results/studies.py)                           |
| `pilot_gate`         | `None`            | [(metric, {column: value}, '>=' | '<=' | '|>=|', k,    |
|                      |                   | 'se' | 'abs')]: what a committed pilot (>= 3 seeds of  |
|                      |                   | its own) must show before the evaluation cells start;  |
|                      |                   | 'se': k standard errors of its seeds; '|>=|': a change |
|                      |                   | of either sign; polgrad/results/gate.py                |
| `pilot`              | `None`            | the pilot's CSV (default results/pilots/<name>_pilot/  |
|                      |                   | <name>_pilot.csv); an experiment that includes this one|
|                      |                   | does not inherit either                                |

Every cell runs in a fresh process as

    python -m polgrad.train <includes...> <spec> --bind <fixed...> --bind <grid...> \\
        --bind '<seed_binding> = <seed>' --out results/<name>/runs/<cell-id> [--resume]

so later wins: the included files, then the spec, then the file's own bindings, then the cell's grid
values, then what `Sweep.budget` sets for the cell (`train.prompts_per_step` and the trainer's stop,
`train.max_sampled_sequences` or `train.max_generated_tokens`), then its seed. `Sweep` lines never
reach the trainer; its environment carries POLGRAD_CELL_ID (the cell id), POLGRAD_EXPERIMENT
(`Sweep.name`) and POLGRAD_CELL_PARAMS (JSON: the spec, the swept bindings as written, the seed),
which name the cell's tracker runs when it sets `train.loggers` (polgrad/tracking.py). Paths in
`include` and `Sweep.specs` are tried relative to the working directory, then to the experiment
file's folder and its parents. The cell id is a readable prefix plus a hash of what the file says
about the cell (includes, spec, bindings, what `Sweep.budget` sets, seed): e.g.
`grpo-k3-loss-s0-1a2b3c4d`. It does not change between runs or machines; editing an included file's
*content* does not change it (start a new experiment name, or delete the run folders, to redo such
cells).

A cell of several ranks (`Sweep.processes_per_cell = k` on CPU, or `num_gpus = k` GPUs) starts the
same trainer command under `Sweep.launcher` instead of plain python; on CPU:

    python -m torch.distributed.run --standalone --nproc_per_node k -m polgrad.train ...
    DS_ACCELERATOR=cpu python -m deepspeed.launcher.runner --num_accelerators k \\
        --master_port <a free port> --no_local_rank --module polgrad.train ... --binding '...'

(torchrun --standalone picks its own free port; DeepSpeed's launcher refuses `--bind` as an
abbreviation of its own options, so there the bindings go as `--binding`, the trainer's other
spelling.) Each rank reads RANK / WORLD_SIZE, joins the gloo group and gets cores // k threads of
the cell's share; the ZeRO stage is the cell's `train.zero_stage` binding. Groups stay on their
rank: each rank samples its own `train.prompts_per_step` prompts and their G samples. The ranks run
in a process group of their own: a failing rank fails the cell (the launcher stops the others; the
error recorded is the first `error:` line any rank printed), and a timeout or ^C stops the whole
group, and then any process still carrying the cell's `--out` folder. A SIGKILL of the sweep (even
of its process group) leaves such a cell's processes running until the sweep starts the cell again,
which stops them first.

Before anything trains, the runner checks every cell the way its trainer will read it
(polgrad/sweep/validation.py): polgrad.config parses the trainer's base config, the includes, the
spec and then each binding (imports, fixed, grid, seed), `gin.finalize()` catches a
`%gin.REQUIRED` left unset, and for polgrad's own trainer `polgrad.config.build()` builds the
cell's Algorithm, TrainConfig and task with every check the trainer makes at its start (a
stand-in `--train-module` gets the parse only). A bad file stops the sweep with one line naming
the file and the binding: an unknown component (with the valid names and the closest match), a
binding to a parameter that does not exist, a bad value, an axis whose values mix types, a
missing include or spec, no seeds, an empty axis or grid, or a grid axis that some cell does not read
when varying it gives otherwise identical cells (polgrad/sweep/reads.py; the rule is in
CONTRIBUTING.md, "Adding an experiment"). With `Sweep.budget` the dry run also sets each cell's
prompts per step from its built Algorithm and refuses a grid it cannot equalise, or cells of
different `train.steps` (polgrad/sweep/budget.py), and a `Sweep.predictions` entry on a metric some run
it compares does not record, e.g. a reward model's `final_gold_reward` on a task-reward sweep
(polgrad/sweep/recorded.py). `--dry-run` marks a swept binding a cell does not read
`(not read)` (the CSV's `not_read`; labels leave it out) and lists the other bindings a cell does not
read (allowed, e.g. a base-config binding of a part the spec does not use).

## Tuning stage

    Sweep.tuning = {'seeds': [100, 101, 102],
                    'grid': {'train.lr': [3e-5, 1e-4, 3e-4], 'Algorithm.kl_coef': [0.01, 0.1]}}

declares tuned baselines (Henderson et al. 2018, "Deep RL that Matters"): the sweep first runs every
configuration of the evaluation (spec + swept bindings) with every value of the tuning grid (axes as
in `Sweep.grid`, zipped ones too) on the tuning seeds, as an experiment of its own named
`<name>_tuning` (its folder inside the experiment's: results/<name>/<name>_tuning/, with the same
lock, skip and resume),
then binds in each configuration's evaluation cells the value with the best mean tuning metric over
the tuning seeds (ties: the first declared; a value with an unstable or failed tuning run ranks
last) and records the choice in experiment.json and in the md's Tuning section (every value's mean).
The tuning metric is `'metric'` (default: `Sweep.primary_metric`) in the direction
`'higher_is_better'` (default: `Sweep.higher_is_better` for the primary metric, True for another):
an experiment whose primary metric is a KL (lower is better) tunes by e.g. `'metric':
'eval_accuracy'`, else it would choose the learning rate that learns least.
The tuning seeds must be disjoint from `Sweep.seeds` (one line naming the overlap otherwise), and a
tuning axis cannot also be a `Sweep.grid` axis. An axis is tuned only in the configurations that
read its bindings (the dry run's reads, as for an axis that changes nothing: `Algorithm.kl_coef` is
not read under `Algorithm.kl = None`), so β is tuned for the specs with a KL term and only the
learning rate for the others. `--dry-run` prints both stages' cells and says which bindings of the
evaluation cells come from tuning. The choice is a function of the tuning CSV; a re-run skips the
finished tuning cells. An evaluation cell's id hashes the declaration (a new grid: new cells); when
the choice changes under evaluation cells that already ran (a tuning cell re-run or restarted), the
sweep stops with one line naming them for `--restart`. A choice at an edge of a numeric axis of at
least 3 values (its best may lie beyond the grid) blocks the evaluation cells, in one line naming
each, until the grid is extended past that edge (finished tuning cells are kept) or `'at_edge'` says
in a sentence why the edge may stand; the md quotes it. `'at_edge'` is not in the cell ids.

    Sweep.tuning = None
    Sweep.tuned_by = 'length_bias_checks'

runs no tuning stage: each configuration's evaluation cells bind the values experiment
`length_bias_checks`' tuning stage chose for it (its results/length_bias_checks/experiment.json, in the
same --results folder), as a replication on new seeds should: re-tuning could choose differently by
chance, and the two experiments would then compare different things. Configurations are matched by
spec and swept bindings (in any axis order); the replication may cover fewer of them. The sweep
refuses in one line when that record is missing or unreadable, has no choice for one of this
experiment's configurations (or its tuning cells all failed there), was tuned on one of its seeds, or
was itself borrowed (name the experiment that tuned). `Sweep.tuned_by` goes into the cell ids; a record
that changed under evaluation cells already run is refused as above, naming them for `--restart`. The
dry run prints the values it would bind, or why not yet. The md's Tuning section names the experiment
that chose. The code: polgrad/sweep/tuning.py and polgrad/sweep/borrow.py.

## Running

    python -m polgrad.sweep experiments/X.gin [--dry-run] [--parallel N] [--executor local|ray]
                            [--ray-address ADDR] [--results DIR] [--restart CELL_ID ...]
                            [--restart-failed]

`--dry-run` validates and prints the cells (id, spec, bindings, seed). Re-running the same file
skips finished cells (summary.json with status ok or unstable), resumes unfinished ones (`--resume` when the
run folder has checkpoints) and re-runs failed ones; another experiment file with the same
`Sweep.name` and results folder is refused (experiment.json records the file). A crashing cell is
recorded as failed with its `error:` line, else the signal that killed it (SIGKILL: usually the
kernel's out-of-memory killer), else the last line of its stderr that is not a progress bar; the
sweep goes on and exits 1 at the end with a summary (2 for a bad
experiment file, 130 when interrupted: ^C or SIGTERM stops the running cells with SIGTERM, and each
finishes its current step and checkpoints it, within 60 s, before the sweep exits). A cell whose
trainer reports status `unstable` (more than `train.unstable_skip_frac` of its optimizer steps
skipped for a non-finite loss or gradient) is finished, not failed: its row says why in `error`,
the md lists it under "Unstable cells (not ranked)", and no ranking or test uses it. A cell whose
checkpoints are all damaged fails with one line saying to start it over: `--restart CELL_ID ...`
(or `--restart-failed`, every cell the CSV records as failed) moves its run folder to
`runs/<cell-id>.old-<time>` and runs it from scratch; its CSV row, pointed at the moved folder,
stays until the new run replaces it. A write that fails (disk full, read-only results folder) stops
the sweep with one line naming the file; the CSV is replaced atomically, so no recorded row is
lost, and a re-run records finished cells from their run folders.

`--executor local` (default) runs cells one at a time, or N at a time with `--parallel N` (fewer
when N cells would not fit in the memory available: polgrad/sweep/memory.py), each
with OMP_NUM_THREADS = cores // N (on a GPU node: each running cell gets its own
CUDA_VISIBLE_DEVICES slice, see `slots.assign_gpu_slots`). `--executor ray` hands cells to Ray as
tasks asking for `num_cpus`/`num_gpus` (a local Ray, or `--ray-address` of a cluster, which must
answer, and have a node that can hold a cell: polgrad/sweep/ray_checks.py); its nodes need
not share a disk: a cell trains in its node's own folder and streams its run folder to the driver,
and a cell whose node dies starts again on another from the checkpoints the driver holds
(polgrad/sweep/ray_cells.py; docs/scaling.md). A cell of k ranks gets a placement group of k
bundles (`Sweep.placement`) and its ranks may land on different nodes. POLGRAD_TRAIN_MODULE (or the
hidden `--train-module`) replaces `polgrad.train` by another module that obeys the same command line.

Results (see polgrad.results), all in the experiment's folder results/<name>/
(polgrad/results/paths.py): <name>.csv (one row per cell, written atomically as each cell ends),
<name>.md (leaderboard), <name>.png (forest plot of the paired differences to the baseline),
<name>_curves.png (learning curves), experiment.json, and runs/<cell-id>/ with config.gin,
metrics.jsonl, summary.json, stdout.log (the trainer's stdout and stderr), cell.json (the cell and
its exact command) and checkpoints/.
When a trainer's summary.json carries a Table-5 row (`summary["table5"]`, a dict), its fields go
into the CSV row as table5_method, table5_type, table5_reward_model, table5_value_function,
table5_reference_policy and table5_core_loss. Its `world_size` and `zero_stage` go into the columns
of those names (the md's "world size" and "ZeRO stage"); a failed cell without a summary records the
ranks the sweep started. Its totals `sampled_sequences`, `kept_sequences` and `generated_tokens` go
into those columns, and the dry run's `prompts_per_step` and `budget_note` (how the cell spends a
step, e.g. "8 prompts × 8 = 64 sequences" or "not sampled: 32 preference pairs per step") beside
them; experiment.json records both and the budget, whose statement heads the md (`**Budget.**`).

## The package

    values.py       gin values as written: GinRef (@kl.k3), GinMacro (%LR), Binding, gin_text
    experiment.py   load_experiment: read and check the file -> Experiment
    grid.py         expand: Experiment -> [Cell] with stable ids; format_cells for --dry-run
    budget.py       Sweep.budget: each cell's prompts per step and stop; a grid it cannot equalise
    recorded.py     the metrics a built cell records; a prediction its runs cannot decide
    validation.py   validate(exp, cells, train_module): every cell parsed with gin before training
    reads.py        which bindings a built cell reads; the refusal of an axis that changes nothing
    slots.py        GPU slots; launch commands (LAUNCH: a dict launcher -> command prefix)
    launch.py       run_cell (a cell's trainer processes and their outcome), stopping them
    executors.py    EXECUTORS: 'local' (thread pool) and 'ray' (Ray tasks); the progress bar
    ray_cells.py    the 'ray' executor: cells and their ranks as Ray tasks, restarted after a lost node
    ray_sync.py     a cell's run folder between its node and the driver (no shared disk)
    ray_checks.py   before Ray waits: a cluster address that answers, cells a node can hold;
                    Sweep.ray's settings
    ray_nodes.py    a node's copies of its cells: held while running, cleaned up after; its output
    memory.py       how many cells at a time fit in this machine's available memory
    disk.py         whether the cells to run may write more than the results disk has free (a warning)
    cli.py          main, prepare, run (lock, skip finished cells, record CSV rows, report)
    tuning.py       Sweep.tuning: the tuning stage's cells, the choice, its binding in the evaluation
    borrow.py       Sweep.tuned_by: the values another experiment's tuning stage chose, bound
"""

from polgrad.sweep.cli import main, prepare, run
from polgrad.sweep.experiment import Experiment, load_experiment
from polgrad.sweep.grid import Cell, expand
from polgrad.sweep.validation import validate

__all__ = ["Cell", "Experiment", "expand", "load_experiment", "main", "prepare", "run", "validate"]
