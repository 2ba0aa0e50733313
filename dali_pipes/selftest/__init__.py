"""``dali-pipes selftest``: every pipeline spec on every device of this machine, on the sample photos.

``runner`` runs the specs and formats the report, ``checks`` says what a good
batch looks like, ``data`` converts the sample photos it reads.
"""
