"""Pure functions of source text: what a program does and what changed in it.

    syntax.py      the AST vocabulary (bodies, scopes, paths, functions, calls)
    analysis.py    a block's side effects (the Flor paper's rules)
    instrument.py  hands-free mode: the script rewritten with loops and blocks
    source.py      manual API: line maps, changed functions, blocks to step into
    probe.py       hands-free replay: hindsight statements and blocks to step into
"""
