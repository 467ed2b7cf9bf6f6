"""The GPU run (one H100/H200): ``bash benchmarks/gpu/session.sh`` runs the
suite's CUDA mode, the step and memory table (``python -m benchmarks.gpu``,
``step.py``) and the host-cost proxy on the device; ``python -m
benchmarks.gpu.memory_sites`` shows where GPU memory is held, by the line
that allocated it."""
