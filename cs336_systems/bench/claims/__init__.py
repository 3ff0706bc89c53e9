"""The tuning guides' DDP claims, measured through PyTorch Lightning.

* configs.py   the configurations: each knob on and off, on torch's DDP (Lightning's
               ``DDPStrategy``) and on ours (``CS336DDPStrategy``), and the claims they test
* record.py    ``ClaimsRecord``: one configuration's step times and peak memory, per round
* run.py       the interleaved rounds (a fresh Trainer per configuration and round) and
               the BatchNorm statistics probe of ``sync_batchnorm``
* verdicts.py  a verdict per claim (holds / does not hold here / not resolved) from the records
"""

from cs336_systems.bench.claims.configs import CLAIMS, CONFIGS, Claim, ClaimsSetting, Config
from cs336_systems.bench.claims.record import ClaimsRecord
from cs336_systems.bench.claims.run import ClaimsRun, run_claims_benchmark
