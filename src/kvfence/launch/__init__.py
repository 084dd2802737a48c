"""The `kvfence serve` command: one parse into `ServeOptions`, then the topology it names."""
