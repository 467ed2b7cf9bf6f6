"""Process groups, meshes, the training step's collectives and the
rendezvous that keeps collective calls paired (``docs/design.md``, layers)."""
