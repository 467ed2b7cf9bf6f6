"""Host cost per unit: the CPU proxy of a launch-bound GPU step.

``python -m benchmarks.host_cost`` times it (``proxy.py``), ``.ab`` compares
this tree with another revision paired step by step, ``.instructions``
counts its instructions under valgrind, ``floor.py`` is the design's floor.
"""
