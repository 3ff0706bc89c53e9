"""The hidden-style suite: one test file per problem, the grader's side of each check
(checks, models) and the rank's side (training).
"""
