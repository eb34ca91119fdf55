"""Testing support, not part of the product: synthetic profiles (synthetic.py), the
independent 1-/2-move local search that measures planner quality (local_search.py), and a
repair that makes any plan fit (repair.py). Imported by tests/ and benchmarks/ only; not
installed with the package."""
