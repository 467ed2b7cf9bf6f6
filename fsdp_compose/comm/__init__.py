"""Process groups, meshes and collectives: everything that talks to
``torch.distributed`` on the data path (see ``docs/design.md``, layers)."""
