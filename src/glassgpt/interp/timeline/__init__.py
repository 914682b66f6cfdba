"""A run seen through its snapshots: `llc.py` (the local learning coefficient by SGLD, held to
devinterp's estimator) and `features_over_time.py` (which known features the weights at each
step represent, and a dictionary trained at the end read back through the steps where it still
reconstructs them).
"""
