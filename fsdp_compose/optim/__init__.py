"""Optimizer steps that know the flat buffers (``flat_step``)."""

from .flat_step import FlatStep, StepReport, flat_step

__all__ = ["flat_step", "FlatStep", "StepReport"]
