"""Fusion passes: replace a matched chain of ops with one fused op."""
