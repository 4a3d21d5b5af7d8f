"""Study: reward-model over-optimisation (Gao et al. 2023). An experiment that names it
(`Sweep.studies = ['studies.overoptimization']`, e.g. experiments/overoptimization.gin) gets, after its
sweep, `python -m studies.overoptimization experiments/X.gin`: best-of-n of each seed's warm start
against its reward model (best_of_n.py), every run cut into points of gold and proxy against sqrt(KL),
the fits of Gao et al. with seed-bootstrap CIs of their peaks (fits.py), written to results/X/X_gao.md
and .png (analysis.py); the sweep's own md quotes that md's answer."""

from polgrad.results.studies import Study

SUFFIX = "_gao"  # results/<experiment>/<experiment>_gao.md and .png: this analysis of the experiment's runs

STUDY = Study(
    title="Over-optimisation",
    outputs=("_best_of_n.csv", "_points.csv", f"{SUFFIX}.md", f"{SUFFIX}.png"),
    answers=(SUFFIX,),
)
