"""Pipeline parallelism, the baseline Xronos is compared against: stage runner, GPipe and
1F1B schedules, the stage cost model, and the pipeline session."""
