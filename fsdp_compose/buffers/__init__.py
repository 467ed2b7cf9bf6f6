"""Storage: the flat layout math, parameter records and dtype rules, one flat
buffer (values and views), its gradient, the CPU staging pool and the
tensor-parallel boundary. Knows nothing of units or of the iteration."""
