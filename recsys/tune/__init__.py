"""``recsys tune``: hyperparameter search over a job's keys with Optuna (TPE, a median pruner
fed each validation evaluation, a study that survives restarts and spans machines).

``space``: the search space file; ``run``: the study, its storage, trials and workers;
``report``: the progress lines, ``best.toml``, the trials table and the plots. Docs:
docs/tuning.md.
"""
