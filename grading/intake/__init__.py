"""Taking a submission in: its files copied and read without following a link, its adapters,
edition and import folders found, all in a limited subprocess.
"""
