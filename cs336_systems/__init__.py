"""Distributed data-parallel training from scratch (CS336 assignment 2, its distributed part).

Vocabulary, fixed across the repo: a *rank* is one process of a job, numbered 0..world_size-1;
the *world size* is the number of ranks; the *local rank* numbers the ranks of one node and
picks its GPU; a *bucket* is a group of gradients reduced by one collective; the *payload* is
the bytes one collective moves per rank; algbw = payload / time and busbw = algbw · 2(n−1)/n
(nccl-tests' definitions); the *step time* is the slowest rank's; the *exposed overhead* is
what a variant's step adds to the same step without communication.

Folders, one technique each (cs336_systems/problems.py maps the handout's problems to them):
ddp/ (data parallelism, the four variants), zero/ (optimizer state sharding), fsdp/ (fully
sharded data parallelism), comm/ (collectives several techniques share), launch/ (starting
ranks), bench/ (every measurement), capacity/ (memory and communication on paper), doctor/
(``make doctor``), results/ (results files), writeup/ (the generated writeup), cli/ (the
scripts' one dialect). The model itself lives in ``cs336_basics`` and knows nothing of them.
"""
