"""The reports: outcomes from the pytest plugin to the harness, scoring by the rubric,
results.json, grade.md, grades.csv and a folder's summary.
"""
