"""pagedray.workers.layers."""
