"""What turns ``fully_shard``'s arguments into units: records, placements, buffers, owners."""
