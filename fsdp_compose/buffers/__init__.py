"""Storage: layout math, parameter records and dtype rules, flat buffers,
their views and gradients, the CPU staging pool, the tensor-parallel
boundary. Knows nothing of units or of the iteration.
"""
