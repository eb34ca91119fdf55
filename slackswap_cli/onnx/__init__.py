"""The ONNX frontend: an exported forward graph -> a profile (importer.py), with the gradient
rules that stand in for autograd (grad_rules.py). Needs the `onnx` package, not torch."""
