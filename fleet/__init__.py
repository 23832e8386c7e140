"""fleetmend's pure domain: models, vocabulary and decision policies.

Nothing in this package performs I/O, reads a clock or draws randomness without
an explicit seed, so workflows may import it freely (Temporal's sandbox) and
the simulator may share its vocabulary.
"""
