"""The readings: a rank's memory and its loopback bytes read from outside it, judged against
the grader's own calibration; the probes inside a rank (hints only); and review, where the
witnesses disagree.
"""
