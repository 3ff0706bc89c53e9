"""The grading harness: the hidden-style suite and the machinery that runs it on any submission.

It never imports this repository's ``cs336_systems``: a submission brings its own.

* problems.py    the handout's problems, points, and which the suite grades per edition
* submission.py  finding a submission's adapters, its edition, loading an adapter in a rank
* ranks.py       running one test's ranks with a deadline; failures as one line
* probes.py      collectives logged (and whether backward was running), bytes an object holds
* cases.py       the rank functions: training through the adapters beside single-process training
* suite/         the hidden-style tests, one file per problem
* plugin.py      pytest plugin: repeats, per-test results as JSON, the grade table
* report.py      results.json (Gradescope's schema), grade.md, grades.csv
* harness.py     grading a checkout or zip: scratch copy, sandbox, limits, clean-up
* __main__.py    ``python -m grading`` (``make grade``)
"""
