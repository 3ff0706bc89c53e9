"""Results files: one typed record per kind, one way to write and read them, one place they live.

* schema.py       records are dataclasses; their JSON form, checked field by field on reading
* files.py        a results file (environment, setting, records), written atomically, read back typed
* environment.py  where and with what a measurement was taken (machine, versions, commit)
* paths.py        ``writeup/results/<machine tag>/<kind>.json``: the one place that knows
* kinds.py        every kind of results file, so a reader can read any of them
"""
