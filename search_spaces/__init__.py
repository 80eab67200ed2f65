"""Per-operator declarative search spaces, constraints and default schedules."""

from rewy_tune.search_spaces.scalar import (
    CONDITIONS,
    constraint,
    default_schedule,
    schedule_from_params,
    space,
)

__all__ = ["CONDITIONS", "constraint", "default_schedule", "schedule_from_params", "space"]
