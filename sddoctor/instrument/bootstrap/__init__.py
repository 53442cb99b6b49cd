"""Holds only `sitecustomize.py`, which `sddoctor run` puts on the job's PYTHONPATH (see `boot`)."""
