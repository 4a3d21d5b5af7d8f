"""This repository's studies: analyses of particular experiments that plug into polgrad's sweep and
report (polgrad/results/studies.py) without being part of the library.

    replication        an experiment beside its replication on other seeds (X and X_replication)
    overoptimization   Gao et al.'s over-optimisation analysis: best-of-n, gold and proxy against
                       sqrt(KL), the fits and their peaks (`python -m studies.overoptimization X.gin`)
    campaign           the check that every committed results CSV comes from one clean tagged commit
                       with the protocol's seeds (`python -m studies.campaign TAG`)

An experiment names the first two in `Sweep.studies`; the campaign check is a command of its own.
Run from the repository root (or put it on PYTHONPATH) so that `studies` imports.
"""
