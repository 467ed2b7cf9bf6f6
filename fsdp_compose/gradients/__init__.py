"""Whole-model gradient features over the units' sharded gradients: clipping, norms, scaling, zero_grad."""
