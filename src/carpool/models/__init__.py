"""Runners that make a model a batched callable. Importing a runner may import torch."""
