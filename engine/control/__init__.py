"""On top of the stages: cancel/reschedule clients, inspecting what waits, status."""
