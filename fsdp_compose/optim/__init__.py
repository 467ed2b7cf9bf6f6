"""Optimizer steps that know the flat buffers (``flat_step``)."""

from .flat_step import FlatStep, StepReport, flat_step, install_default_flat_step  # noqa: F401 (the last for api)

__all__ = ["flat_step", "FlatStep", "StepReport"]
