"""Triton kernels. Each launcher takes a validated `kda.contract.KDACall`."""
