"""Offline JSON Schemas for `tuneproof lint` (package data; see build.py for where they come from)."""
