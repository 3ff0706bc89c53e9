"""``bucket_size_mb="auto"`` against the 25 MB default on a family of differently shaped models.

One bucket-size rule has to serve models whose gradients come in very different pieces, so
the family spans them: many small parameters, a few huge ones, stock ``torch.nn`` layers, and
our LM at its CPU size. Each model is timed with the step benchmark's variants (compute-only,
bucketed-auto, bucketed-25MB, torch-ddp) and its step timing, interleaved in one run.

* models.py   the family: what each model stresses, and building it
* setting.py  FamilySetting: which models, the rounds (the script's flags)
* run.py      one process group times every model's variants; auto is warmed up through its tuning
* record.py   FamilyRecord, one per model in ``bucket_family.json``
"""

from cs336_systems.bench.family.models import FAMILY, FamilyMember
from cs336_systems.bench.family.record import FamilyRecord
from cs336_systems.bench.family.run import FAMILY_VARIANTS, FamilyRun, run_family_benchmark
from cs336_systems.bench.family.setting import FamilySetting
