"""The DDP doctor (``make doctor``): one short diagnostic run that checks a job's data-parallel
set-up, rank by rank.

It answers the questions asked when DDP "only trains on one rank" or hangs:

* did every rank start and reach the first step? Each rank checks in through the rendezvous
  store (a key per rank); rank 0 names the ranks missing after ``checkin_timeout_s``;
* is one rank slower than the others? Each rank times the compute of a few training steps
  (forward and backward, before waiting for gradients), since in DDP the other ranks'
  step time includes waiting for the slowest one;
* do the ``DistributedSampler`` shards split the data? Every rank's indices are gathered and
  checked for overlaps and for indices no rank gets;
* do the replicas hold the same parameters? Checksums of every parameter are compared across
  ranks before any broadcast, after wrapping in DDP, and after the training steps;
* what do all-reduces cost here? The repo's one all-reduce calibration
  (:func:`cs336_systems.ddp.auto_bucket.calibrate_allreduce`, the one ``bucket_size_mb="auto"``
  uses) fits ``time = o + bytes / w``, and the doctor suggests the bucket size ``sqrt(s w o)``
  for the model's ``s`` gradient bytes (:mod:`cs336_systems.ddp.overhead_model`).

Each problem becomes a *finding*: a sentence that says what is wrong, with the values seen, and
what usually causes it. ``inject`` plants one known fault, to test the doctor and to show what
each finding looks like.

Inside the user's own job, the same questions are asked of their training: :class:`JobDoctor`
(in_job.py) in a plain PyTorch loop, ``DoctorCallback`` (callback.py) in a Lightning Trainer.

* in_job.py        JobDoctor: hooks on the user's model, optimizer and loader; the report
* callback.py      DoctorCallback: JobDoctor in Lightning (imports Lightning)
* job_findings.py  the in-job findings: per-rank observations in, sentences out
* setting.py   DoctorSetting (the script's flags) and the faults it can plant
* run.py       the ranks: check-in, training steps, checksums, calibration; run_doctor
* findings.py  pure finders: gathered measurements in, sentences out
* diagnose.py  every finder over one scenario's measurements: the report
* report.py    DoctorReport, the results record ``--out`` writes (kind "doctor")
* format.py    the console report and the exit status
"""

from cs336_systems.doctor.diagnose import build_report
from cs336_systems.doctor.findings import (
    AFTER_FIRST_STEP,
    AFTER_TRAINING,
    AFTER_WRAPPING,
    BEFORE_BROADCAST,
    STAGE_CAUSES,
    ParameterChecksum,
    find_missing_ranks,
    find_parameter_mismatches,
    find_shard_problems,
    find_stragglers,
    ranks_text,
)
from cs336_systems.doctor.format import exit_status, format_job_report, format_report
from cs336_systems.doctor.in_job import DoctorTimeout, JobDoctor
from cs336_systems.doctor.report import CalibrationRow, DoctorReport, RankInfo
from cs336_systems.doctor.run import DoctorRun, parameter_checksums, run_doctor, run_doctor_scenarios
from cs336_systems.doctor.setting import (
    FAULTY_RANK,
    INJECTIONS,
    MISSING_RANK,
    OVERLAPPING_SHARDS,
    STRAGGLER,
    UNSEEDED,
    DoctorSetting,
)
