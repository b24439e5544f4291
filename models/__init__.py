"""Model families (``models/<name>/``: the model, its flavors, its parallelize plan, its HF adapter), the
layers they share (attention.py, loss.py), the ``ModelSpec`` (spec.py) and the registry (registry.py)."""
