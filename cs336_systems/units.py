"""Byte units, defined once for the whole repo.

Bucket and payload sizes given "in MB" are mebibytes (2**20 bytes), as torch DDP's
``bucket_cap_mb`` is; the writeup says "MB" for them, and so do the command-line flags.
"""

KB = 2**10
MB = 2**20
GB = 2**30
