"""Per-operator declarative search spaces, constraints and default schedules."""
