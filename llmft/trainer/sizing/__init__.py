"""The CPU arithmetic that sizes a run, apart from the GPU kernels (llmft/trainer/fastpath/): the memory model
of a training step (``memory``). It imports no torch, no transformers and no GPU package, so the plan step
runs it in the pipeline image, which installs none of them (docker/Dockerfile.pipeline);
tests/core/test_imports.py holds it to that."""
