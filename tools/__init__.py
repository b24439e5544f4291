"""Scale tools: dry run, memory estimate, planner, SLURM templates, sweeps, HF conversion. The engine never
imports them; they call the functions the trainer calls."""
