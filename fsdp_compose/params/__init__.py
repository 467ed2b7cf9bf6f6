"""Whole-value features: deferred init, full values."""
