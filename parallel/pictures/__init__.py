"""Pictures a run leaves for a person to look at, drawn with matplotlib's Agg backend (no display needed).

Each module takes plain numbers (no models, no process groups) and writes a PNG or returns its bytes for
TensorBoard; the callers above decide when and where.
"""
