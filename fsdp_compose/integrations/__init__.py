"""Adapters for training frameworks. Each submodule imports its framework;
this package imports none."""
