"""Draftsmith export stage."""
