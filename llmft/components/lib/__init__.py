"""The logic of the pipeline components (each component in llmft/components/ is a thin wrapper around a
module here). docs/architecture.md ("Who owns which step") names the module behind each step.

Nothing heavy is imported here: import the submodule you need.
"""
