"""Checks that turn misuse into a clear error on every rank: rank
divergence, parameters registered after annotation, composition with
``replicate``, non-finite gradients, optimizer steps on unready gradients.
Installed by ``fully_shard`` (``setup/units.py``) and the module methods."""
