"""Adapters for the training frameworks people run fsdp_compose in.

Each submodule imports its framework, so importing this package imports
none of them: ``from fsdp_compose.integrations.lightning import
ModelParallelStrategy`` needs Lightning installed (``pip install
fsdp_compose[lightning]``), ``import fsdp_compose`` never does.
"""
