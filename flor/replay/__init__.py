"""The parent process of ``python -m flor replay``.

    plan.py     the Plan (one JSON writer and reader), planning, segments
    workers.py  running the segments: local worker processes, or --part
    results.py  assembling the output, running the checks, merge
    checks.py   the deferred checks
    causes.py   every likely-cause heuristic of the checks
"""
