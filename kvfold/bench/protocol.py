"""What a bench cell reports: a cell process prints one line, MARK + JSON, per finished phase,
and a cell that hit a limit ends in one of the statuses below (kvfold's and llama.cpp's alike)."""

MARK = "@@kvfold-bench "
SKIP_TIME = "skipped: > time limit"
OOM = "out of memory"
SYNTHETIC = "not timed: synthetic context"  # a prefill that --context-fill synthetic replaced
