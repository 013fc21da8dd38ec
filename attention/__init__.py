"""pagedray.attention."""
