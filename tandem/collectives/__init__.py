"""Collective communication: process groups, algorithms and the torch-compatible API."""
