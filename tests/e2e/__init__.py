"""End-to-end tests: the CLI, Slurm, vLLM."""
