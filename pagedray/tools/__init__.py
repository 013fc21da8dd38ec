"""Tools beside serving: the offline, seeded default-model builder."""
