"""The evaluate step: perplexity of every checkpoint, task scores, comparisons and generations."""
