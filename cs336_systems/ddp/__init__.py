"""Data parallelism with replicated parameters (DDP), from scratch: the handout's variants.

Vocabulary: a *rank* is one process; the *world size* the number of ranks; a *bucket* a group
of gradients reduced by one all-reduce; the *payload* the bytes one collective moves.

* base.py          what every variant shares (broadcast, buffers, no_sync, unused parameters)
* naive.py         problem 2: one all-reduce per gradient after backward
* flat.py          problem 4: one all-reduce of all gradients flattened
* overlap.py       launching all-reduces from gradient hooks, in one order on every rank
* per_parameter.py problem 5: one async all-reduce per parameter, during backward
* bucket.py        a bucket (many gradients in one buffer, with their usage flags) and the plan
                   that assigns parameters to buckets, as torch's DDP assigns them
* bucketed.py      problem 6: buckets of about bucket_size_mb, each reduced when full
* auto_bucket.py, calibration.py, overhead_model.py  problem 6b: the overhead model, the all-reduce
                   calibration and ``bucket_size_mb="auto"``
* variants.py      the registry of variants every other part uses
* torch_keywords.py  torch's DistributedDataParallel keywords, read into ours (or refused in one line)
"""

from cs336_systems.ddp.auto_bucket import AutoBucketedDDP
from cs336_systems.ddp.base import DataParallel
from cs336_systems.ddp.bucketed import BucketedDDP
from cs336_systems.ddp.flat import FlatDDP
from cs336_systems.ddp.naive import NaiveDDP
from cs336_systems.ddp.per_parameter import PerParameterDDP
from cs336_systems.ddp.variants import VARIANTS, Variant, variant
