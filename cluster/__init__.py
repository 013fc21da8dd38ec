"""pagedray.cluster."""
