"""Training the draft: the rollout buffer, training-time unrolling, the trainer, the warm start, evaluation and
checkpoints."""
