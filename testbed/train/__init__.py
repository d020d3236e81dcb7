"""Data-parallel training jobs over any collective: real models on data that ships with Python
and scikit-learn, injected stragglers, DropCompute, and per-step records for metrics.

Import from the modules: `config` (the job's configuration, torch-free: scenarios read it),
`job` (`Job`, `train`, step records), `stragglers`, `dropcompute`, `strategies`, `diloco`
(DiLoCo and Streaming DiLoCo), `models`, `data`.
"""
