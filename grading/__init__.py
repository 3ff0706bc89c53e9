"""The grading harness: the hidden-style suite and the machinery that runs it on any submission.

It never imports this repository's ``cs336_systems``: a submission brings its own. One folder
per stage a submission goes through, each opening with the part it plays:

* intake/     taking a submission in: files copied and read without following a link (files),
              adapters, edition and import folders found in a limited subprocess (intake,
              submission)
* isolation/  the processes that run its code: one test's ranks forked from a confined fork
              server (ranks, rank_server), their uid (student), namespaces and view of the file
              systems (sandbox, containment), CPU share and memory cgroups (share, rank_cgroups),
              what crosses back (wire, never a pickle), what a test leaves scrubbed (scrub)
* readings/   what the grader reads from outside a rank (outside: memory at pauses; traffic:
              loopback bytes at holds), judged (memory, carried) and reviewed where witnesses
              disagree (review); probes inside a rank, hints only
* suite/      the hidden-style tests, one file per problem; the grader's side of each check
              (checks, models) and the rank's (training)
* reports/    outcomes to the harness over a pipe (plugin, outcomes); scoring by the rubric,
              results.json, grade.md, grades.csv (report); a folder's summary (summary)
* course/     a folder of submissions, here or through submitit (course); the Gradescope
              package (autograder)

At the top: problems.toml and problems.py (the handout's problems, points and rubric),
harness.py (grading one checkout or zip: scratch copy, containment, limits, results once all is
gone), selfcheck.py (the grader's own probe submission), __main__.py (``make grade``).
"""
