"""Data sources: each yields this rank's slice of the global batch for a step."""
from parallel.data.synthetic import SyntheticData

__all__ = ["SyntheticData"]
