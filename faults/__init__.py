"""Fault injection (issue 11): `python -m faults` runs every scenario in faults/f_*.py; see faults/harness.py."""
