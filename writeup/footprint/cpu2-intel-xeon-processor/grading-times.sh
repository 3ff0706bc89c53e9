#!/bin/bash
set -u
cd /work/main
t() { local label=$1; shift; local s=$(date +%s.%N); "$@" > /tmp/gt_$label.log 2>&1; local rc=$?; local e=$(date +%s.%N); echo "$label rc=$rc wall=$(python3 -c "print(round($e-$s,1))") load=$(cut -d' ' -f1-3 /proc/loadavg) score=$(grep -ho 'total (tested problems).*' /tmp/gt_$label.log | tr -s ' ' | tail -1)"; }
for i in 1 2; do
  for r in 1 2 3; do
    rm -rf /tmp/gt_out; t r${r}_$i make grade SUBMISSION=/tmp/answers_sub REPEATS=$r OUT=/tmp/gt_out
  done
  rm -rf /tmp/gt_old; t old_r3_$i bash -c "cd /work/wt/old93 && .venv/bin/python -m grading /tmp/answers_sub --repeats 3 --out /tmp/gt_old"
done
for i in 1 2; do
  rm -rf /tmp/gt_f1; t jobs1_$i make grade SUBMISSIONS=/tmp/gfolder OUT=/tmp/gt_f1 JOBS=1
  rm -rf /tmp/gt_f2; t jobs2_$i make grade SUBMISSIONS=/tmp/gfolder OUT=/tmp/gt_f2 JOBS=2
done
