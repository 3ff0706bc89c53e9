"""Read this first: the handout's answers, one file per problem, readable top to bottom.

Each file is what a strong student hands in for one problem of CS336 assignment 2's distributed
part, with comments that quote the handout sentence each piece answers. They import only torch
(and FSDP the course's ``cs336_basics``, whose Linear and Embedding it shards):

  naive_ddp.py                          naive_ddp: broadcast, then all-reduce each gradient after backward
  ddp_overlap_individual_parameters.py  ddp_overlap_individual_parameters: async all-reduce in gradient hooks
  ddp_bucketed.py                       ddp_overlap_bucketed (2025): buckets in reverse order, each sent when full
  sharded_optimizer.py                  optimizer_state_sharding: each rank steps ~1/world_size, then broadcasts
  fsdp.py                               fsdp (2026): sharded Linear/Embedding weights, all-gather, reduce-scatter
  adapters.py                           the handout's adapter functions (both editions), bound to these

The public test files of both editions run on them (``CS336_IMPL=answers`` switches the
repository's adapters.py to these), the grader (``python -m grading``) gives them full points
(tests/answers_fixture.py builds the submission it grades), and the rest of ``cs336_systems``
(ddp/, zero/, fsdp/) is the library: the same techniques, plus what torch's DDP and FSDP handle
and these answers do not. writeup/details/from_answer_to_library.md lists each such thing with
the test that fails on the answer and passes on the library.
"""
