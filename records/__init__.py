"""The record tools: claims over repeated runs, seed-matched ablations, script diffs, pictures.

    records/runlogs.py    finds and reads run logs, and says which runs are the same experiment
    records/published.py  the upstream medium-track records as data (records/published.json)
    records/stats.py      does a set of runs support a claim? (command line)
    records/ablate.py     seed-matched sweeps of trainer configurations, interleaved A/Bs of commands (command line)
    records/diff.py       what a record changes: script and config (command line)
    records/plot.py       validation curves, quality against cost, learned lambdas (command line)
    records/summary.py    one screen about a batch of runs (run.sh calls it after RUNS=N)

Each command-line script puts the repository root on sys.path in place of its own folder and
imports its siblings as `from records import ...`, so nothing here is importable under a bare name
such as `stats`.
"""
