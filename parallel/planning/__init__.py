"""Planning a run before it starts: the memory planner and its stand-ins, the step's work, communication and
CUDA accounting, the cost model, the calibration and its runs, the replay, FLOPs, the hardware's rates and
strategy=auto (Note [planner] in planner.py)."""
