"""Running a schedule: checkpointed regions, applying and removing a schedule, what a scheduled
model watches, and the step harness every measured step goes through."""
