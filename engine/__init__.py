"""Scheduling and model execution: ``core/`` plans and schedules without torch; ``runtime/`` carries the plans out
with torch; ``chooser`` builds the engine a configuration asks for."""
