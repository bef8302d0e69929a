"""Benchmarks of ringtrain against torch's own collectives and DDP, and the emulated networks they run on."""
