"""Draftsmith train stage."""
