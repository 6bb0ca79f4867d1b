"""distrain: distributed SGD strategies on Ray, one flag apart."""

__version__ = "0.1.0"
