"""lm-evaluation-harness task configs (YAML) and their data, run offline by the evaluate step."""
