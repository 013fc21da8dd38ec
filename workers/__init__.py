"""pagedray.workers."""
