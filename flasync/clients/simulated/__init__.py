"""Simulated clients: coroutines over a population with speeds, faults and availability."""
