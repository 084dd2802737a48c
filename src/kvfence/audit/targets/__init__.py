"""Target adapters: one module per engine, a registry, `--engine auto` detection."""
