"""Decisions made before (or between) training runs, in plain numpy: memory and communication per layout
(:mod:`.planner`), predicted step time (:mod:`.step_time`) and expert placement from routing statistics
(:mod:`.placement`). Nothing here opens a process group.
"""
