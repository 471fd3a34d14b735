"""State providers: live training state as an ordered stream of items with VPS coordinates, and back.

Knows nothing of storage (that is ``io_engine``) and nothing of DeepSpeed engine internals beyond
the objects it is handed.
"""
