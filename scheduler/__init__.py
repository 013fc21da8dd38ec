"""pagedray.scheduler."""
