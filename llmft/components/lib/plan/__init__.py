"""The plan step: parameters resolved and checked once into ``plan.json``, and the volume layout."""
