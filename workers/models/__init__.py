"""pagedray.workers.models."""
