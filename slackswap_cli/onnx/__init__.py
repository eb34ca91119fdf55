"""The ONNX frontend: an exported forward graph -> a profile (importer.py composes load.py,
graph_reader.py, folding.py, op_units.py and builder.py), with the gradient rules that stand in
for autograd (grad_rules.py). Needs the `onnx` package, not torch."""
