"""Collectives under study: lossy all-reduce, Moshpit averaging, and the ring and gloo baselines."""
