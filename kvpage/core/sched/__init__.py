"""Scheduling: the waiting queue, the iteration-level scheduler and the step metadata it emits."""
