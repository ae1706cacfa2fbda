"""Running a job: the workers' side (open a session, run the loop, report) and the
parent's (check the inputs, launch one worker per device, show progress, write the run
directory)."""
