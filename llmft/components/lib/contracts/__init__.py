"""The bottom layer of components/lib: what every concern (plan, jobs, evaluation, serving, registry) agrees on
and none owns: the run plan's schema, the volume's paths, pod parts, metric definitions and their direction.
Nothing here imports another module of llmft.components (pyproject.toml's import-linter contract for lib)."""
