"""EAGLE-3 (Li et al. 2025) as a specdec plugin: draft model, proposer, training objective, checkpoints."""
