"""Fakes of outside systems: real servers and real processes that speak the real protocols."""
