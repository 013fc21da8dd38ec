"""The `pagedray` command: `serve`, `generate` and `dashboard`."""
