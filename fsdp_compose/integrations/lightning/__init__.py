"""fsdp_compose under Lightning: ``fabric.ModelParallelStrategy`` for
Lightning Fabric, ``pytorch.ModelParallelStrategy`` for the Lightning
Trainer, each Lightning's strategy of the same name taught fsdp_compose
models (their checkpoints in ``_checkpoints.py``). Importing this package
imports no Lightning; its modules do (the ``[lightning]`` extra)."""
