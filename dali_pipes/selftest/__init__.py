"""``dali-pipes selftest``: every pipeline spec on every device of this machine, on small datasets made at run time.

``runner`` runs the specs and formats the report, ``checks`` says what a good
batch looks like, ``data`` makes the synthetic image, COCO-style and feature
datasets it reads (with the real converters).
"""
