"""Checks that turn misuse into a clear error on every rank."""
