"""fsdp_compose under Lightning (Fabric and Trainer strategies). Imports no
Lightning; its modules do."""
