"""sbatch templates and site environment hooks for `tandem launch slurm`, shipped as package
data."""
