"""Draftsmith data stage."""
