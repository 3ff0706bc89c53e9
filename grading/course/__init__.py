"""The course: a folder of submissions graded here or through submitit, and the Gradescope package.
"""
