"""Cost of a group on a target GPU."""
