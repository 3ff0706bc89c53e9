"""The grading harness: the hidden-style suite and the machinery that runs it on any submission.

It never imports this repository's ``cs336_systems``: a submission brings its own.

* problems.toml  the handout's problems, points and editions (also read by cs336_systems/problems.py),
                 and the rubric: each graded test's share, and the caps
* problems.py    those, which problems the suite grades per edition, and the rubric
* files.py       copying a submission and reading its files as root: no link followed, regular files, bounded
* intake.py      unpack, adapters, edition and packages, found in a limited subprocess
* submission.py  finding a submission's adapters, packages and edition; loading an adapter in a rank
* ranks.py       one test's ranks: forked, confined, the submission last on their path, a deadline
* wire.py        what ranks send back: JSON and raw tensor bytes, never a pickle
* models.py      the suite's models, built in a rank and, as the reference, in the grader
* training.py    what a rank does: train through the adapters and report (rank side)
* checks.py      what the grader does: data, reference training, comparisons (never imports the submission)
* probes.py      collectives logged (during backward? bytes carried? left running?); tensors an object holds (a hint)
* outside.py     a rank's memory, read by the grader while the rank is stopped at a pause
* rank_cgroups.py a memory cgroup per rank: the kernel's charge for all it and its processes hold
* memory.py      sharding judged from those readings: optimizer state per rank, FSDP weight by weight, freed after use
* traffic.py     the bytes the ranks carried, read by the grader from the run's own loopback while all ranks are held
* carried.py     FSDP's and DDP's traffic judged from those readings, against gloo's own collectives (calibrated)
* suite/         the hidden-style tests, one file per problem, each naming the handout's requirement
* plugin.py      pytest plugin: repeats, each outcome to the harness over a pipe
* report.py      scoring by the rubric (also make test's), results.json (Gradescope's schema), grade.md, grades.csv
* sandbox.py     the first process of a run (not dumpable), and the ranks' view of the file systems
* rank_server.py the fork server's first act: as privileged as a rank, no more
* student.py     as root: a uid of its own per submission; every process of it killed, its files removed
* containment.py the three ways a run is contained (root, namespaces, neither) and its end
* share.py       a CPU share and a task limit per run (a cgroup of its own, where one can be made),
                 the parent of its ranks' memory cgroups
* outcomes.py    the outcome pipe read as the run goes: early stop, an interrupted grader
* harness.py     grading a checkout or zip: scratch copy, containment, limits, results once all is gone
* course.py      a folder of submissions, a process each here or a job each through submitit; reruns; names
* summary.py     a folder's summary.md and summary.png
* autograder.py  ``make autograder``: the Gradescope package
* __main__.py    ``python -m grading`` (``make grade``)
"""
