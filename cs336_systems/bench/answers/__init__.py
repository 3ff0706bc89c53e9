"""Step time of the answers (cs336_systems/answers/) beside the library and torch, in one run.

For each technique the handout asks for, three implementations train the same LM, each on its
own copy, interleaved round by round (configurations.py): the answer, the library's wrapper and
torch's own (DistributedDataParallel, ZeroRedundancyOptimizer, fully_shard). ``answers_step.json``
holds one record per (technique, implementation); the writeup's "From the answer to the library"
page shows them. ``scripts/bench_answers.py`` runs it; ``make bench`` includes it.
"""

from cs336_systems.bench.answers.record import AnswersStepRecord
from cs336_systems.bench.answers.run import AnswersSetting, run_answers_benchmark

__all__ = ["AnswersSetting", "AnswersStepRecord", "run_answers_benchmark"]
