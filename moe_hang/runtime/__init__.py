"""Processes on this machine, no reasoning: launching, tracking and ending them, finding a
job's ranks, watching their heartbeats, run directories."""
