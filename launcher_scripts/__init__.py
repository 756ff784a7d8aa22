"""Turns the composed training config into jobs for this machine, Slurm or Kubernetes.

Imports `framework.config` only (never torch.distributed): the launcher may run where torch is absent.
"""
