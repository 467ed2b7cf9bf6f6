"""Whole-value features over the units' parameters: deferred init, materialization, full values."""
