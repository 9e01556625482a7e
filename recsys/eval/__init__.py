"""Offline evaluation: metrics on predictions (numpy only)."""
