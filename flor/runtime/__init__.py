"""What runs inside the user's script process.

    session.py     loops, blocks and logs of one process (Session, Inert)
    recording.py   record: the adaptive decision, checkpoint writing, the run row
    replaying.py   replay: the worker's segment, checkpoint lookup, restoring
    blockstate.py  what a block checkpoint holds, and putting it back
    logbook.py     logged values, printed lines and output, stored as the run goes
    capture.py     stdout/stderr/excepthook capture
    handsfree.py   the runtime that instrumented scripts call
    script.py      running the script as __main__
"""
