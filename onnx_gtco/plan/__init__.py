"""Planning: legal candidate groups and the dynamic program that picks among them. Pure functions only."""
