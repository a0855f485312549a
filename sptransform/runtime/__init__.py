"""What runs on a rank: collectives, rank-aware ops, the parallel module and its parameters."""
