"""Training: the one step loop, the strategy seam, the tensor-parallel session and trainer,
batches, evaluation and greedy decoding."""
