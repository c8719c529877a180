"""What a bench cell process prints to report a finished phase: one line, MARK + JSON."""

MARK = "@@kvfold-bench "
